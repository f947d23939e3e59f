"""What a user's tool code may expect of its interpreter (issue 42; docs/sandbox.md "The interpreter").

`sys.executable` exists inside the sandbox and starts this same Python with the same packages, so
`subprocess.run([sys.executable, ...])` and multiprocessing's spawn and forkserver work; a cell is the
`__main__` module, so its own functions reach workers of a forked Pool or a ProcessPoolExecutor. All
of it stays inside the call's confinement and limits. Before, the sandbox's root lacked the
interpreter (FileNotFoundError) and a cell's functions could not be pickled at all.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tirl.sandbox import Sandbox, Status

session_loop = pytest.mark.asyncio(loop_scope="session")


def light_pool(**options: object) -> Sandbox:
    base = {"slots": 1, "preload": [], "warmup": [], "limits": {"timeout_s": 30.0, "memory_mb": 512}}
    return Sandbox(**(base | options))  # type: ignore[arg-type]


@session_loop
async def test_sys_executable_starts_the_same_confined_python():
    import tirl

    project_file = str(Path(tirl.__file__).parent / "cli.py")
    facts = f"import json, os, sys; print(json.dumps([sys.prefix, sys.version, os.getuid(), os.path.exists({project_file!r})]))"
    code = textwrap.dedent(f"""
        import subprocess, sys
        out = subprocess.run([sys.executable, "-c", {facts!r}], capture_output=True, text=True, timeout=20)
        print(out.stdout.strip() or out.stderr[-300:])
        {facts}
    """)
    async with light_pool() as sb:
        r = await sb.run(code)
    assert r.status == Status.OK, r
    child, parent = (json.loads(line) for line in r.stdout.splitlines())
    assert child == parent and child[3] is False, "the same Python, confined alike, without the project"


@session_loop
async def test_multiprocessing_reaches_a_cells_own_functions_and_spawn_starts():
    cells = {
        "fork": "import multiprocessing as mp\ndef sq(x):\n    return x * x\n"
        "with mp.get_context('fork').Pool(2) as p:\n    print(p.map(sq, range(5)))",
        "executor": "from concurrent.futures import ProcessPoolExecutor\ndef sq(x):\n    return x * x\n"
        "with ProcessPoolExecutor(2) as ex:\n    print(list(ex.map(sq, range(5))))",
        "spawn": "import math, multiprocessing as mp\n"
        "with mp.get_context('spawn').Pool(2) as p:\n    print(p.map(math.factorial, range(5)))",
    }
    expected = {"fork": "[0, 1, 4, 9, 16]\n", "executor": "[0, 1, 4, 9, 16]\n", "spawn": "[1, 1, 2, 6, 24]\n"}
    async with light_pool() as sb:
        for name, code in cells.items():
            r = await sb.run(code)
            assert (r.status, r.stdout) == (Status.OK, expected[name]), (name, r)


@session_loop
async def test_a_sessions_functions_from_earlier_cells_reach_its_workers():
    async with light_pool() as sb, await sb.open_session() as session:
        await session.run("def cube(x):\n    return x ** 3")
        r = await session.run(
            "import multiprocessing as mp\nwith mp.get_context('fork').Pool(2) as p:\n    print(p.map(cube, range(4)))"
        )
        assert (r.status, r.stdout) == (Status.OK, "[0, 1, 8, 27]\n"), r
        r = await session.run(
            "import subprocess, sys\nprint(subprocess.run([sys.executable, '-c', 'print(7)']).returncode)"
        )
        assert r.stdout == "7\n0\n", r


@session_loop
async def test_processes_the_interpreter_starts_count_against_the_calls_limits():
    code = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'while True: pass'])"
    async with light_pool(limits={"timeout_s": 2.0, "memory_mb": 512}) as sb:
        r = await sb.run(code)
        assert r.status == Status.TIMEOUT, r
        assert (await sb.run("print(1)")).stdout == "1\n", "the slot serves on: the child died with the call"
