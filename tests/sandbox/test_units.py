"""Small pieces: output capture, limits, the rendered text the model sees, the SandboxFusion mapping."""

from __future__ import annotations

import json

import pytest

from tirl.sandbox import ExecResult, Limits, Sandbox, Status
from tirl.sandbox.capture import StreamCapture
from tirl.sandbox.fusion import to_fusion
from tirl.sandbox.imports import stdlib_only

from .hostcheck import children, fork_server, processes_of_uids

session_loop = pytest.mark.asyncio(loop_scope="session")


def test_capture_keeps_head_and_tail_and_counts_the_rest():
    cap = StreamCapture(keep=4)
    for chunk in (b"ab", b"cdef", b"ghij", b"kl"):
        cap.feed(chunk)
    assert (bytes(cap.head), bytes(cap.tail), cap.total, cap.dropped) == (b"abcd", b"ijkl", 12, 4)
    assert cap.text() == "abcd\n[... 4 B truncated ...]\nijkl"
    small = StreamCapture(keep=8)
    small.feed(b"\xffok")
    assert small.text() == "\\xffok"


def test_limits_are_clamped_to_server_maxima():
    maxima = Limits(timeout_s=10, memory_mb=512)
    sb = Sandbox(slots=1, limits={"timeout_s": 2}, maxima=maxima)
    assert sb.call_limits().timeout_s == 2
    assert sb.call_limits(timeout=60).timeout_s == 10
    assert sb.call_limits(limits={"memory_mb": 4096}).memory_mb == 512
    with pytest.raises(ValueError, match="memory_mb"):
        sb.call_limits(limits={"memory_mb": 1})


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (ExecResult(Status.OK, stdout="42\n", wall_ms=12.3), "42\n[ok, 12 ms]"),
        (ExecResult(Status.OK, wall_ms=3), "[ok, 3 ms]"),
        (
            ExecResult(Status.TIMEOUT, stdout="partial\n", message="Timed out after 5.0 s", wall_ms=5003),
            "partial\n[timeout: Timed out after 5.0 s]",
        ),
        (
            ExecResult(Status.MEMORY_LIMIT, message="MemoryError: memory limit is 1 GiB", wall_ms=230),
            "[memory_limit: MemoryError: memory limit is 1 GiB; 230 ms]",
        ),
        (
            ExecResult(Status.KILLED_BY_SIGNAL, message="killed by SIGSEGV", signal=11, wall_ms=1500),
            "[killed_by_signal: killed by SIGSEGV; 1.50 s]",
        ),
        (
            ExecResult(
                Status.RUNTIME_ERROR,
                stderr="Traceback ...\nOSError: [Errno 101] Network is unreachable\n",
                message="OSError: [Errno 101] Network is unreachable",
                wall_ms=20,
                extra={"network_blocked": True},
            ),
            "Traceback ...\nOSError: [Errno 101] Network is unreachable\n[runtime_error: network access is disabled; 20 ms]",
        ),
        (
            ExecResult(
                Status.OK,
                stdout="a\n[... 73 MiB truncated ...]\nz\n",
                stdout_truncated_bytes=76546048,
                wall_ms=900,
                extra={"keep_bytes": 8192, "stdout_bytes": 76562432},
            ),
            "a\n[... 73 MiB truncated ...]\nz\n[ok: output truncated: first and last 8 KiB of 73 MiB shown; 900 ms]",
        ),
        (
            ExecResult(Status.QUEUE_TIMEOUT, message="no free slot within 60 s"),
            "[queue_timeout: no free slot within 60 s]",
        ),
    ],
)
def test_render(result, expected):
    assert result.render() == expected


def test_sandboxfusion_mapping():
    ok = to_fusion(ExecResult(Status.OK, stdout="1\n", exit_code=0, wall_ms=10))
    assert ok["status"] == "Success" and ok["run_result"]["execution_time"] == 0.01
    mem = to_fusion(ExecResult(Status.MEMORY_LIMIT, message="MemoryError: memory limit is 1 GiB", signal=9))
    assert mem["status"] == "Failed" and mem["run_result"]["return_code"] == -9
    assert "memory limit" in mem["run_result"]["stderr"]
    infra = to_fusion(ExecResult(Status.SANDBOX_ERROR, message="slot died"))
    assert infra["status"] == "SandboxError" and infra["run_result"] is None


def test_result_roundtrip():
    r = ExecResult(Status.TIMEOUT, stdout="x", message="Timed out after 1.0 s", extra={"queue_ms": 1.0})
    assert ExecResult.from_dict(r.to_dict()) == r


def test_a_results_dict_is_plain_valid_json_and_its_own_copy():
    r = ExecResult(Status.OK, extra={"addresses": ("0x1",), "nested": {"k": [1]}})
    r.stdout, r.extra["note"] = "a\udc80", "b\ud800"  # set after construction: still made valid
    d = r.to_dict()
    assert json.loads(json.dumps(d, ensure_ascii=False)) == d and type(d["status"]) is str
    assert (d["stdout"], d["extra"]["note"], d["extra"]["addresses"]) == ("a\\udc80", "b\\ud800", ["0x1"])
    d["extra"]["nested"]["k"].append(2)
    assert r.extra["nested"] == {"k": [1]}, "the dict shares nothing mutable with the result"


@session_loop
async def test_per_call_limits_apply(pool):
    big = "x = bytearray(100 * 2**20)\nprint(len(x) >> 20)"
    assert (await pool.run(big)).stdout == "100\n"
    small = await pool.run(big, limits={"memory_mb": 64})
    assert small.status == Status.MEMORY_LIMIT and small.message == "MemoryError: memory limit is 64 MiB"
    procs = await pool.run(
        "import os\nkids = []\ntry:\n    for _ in range(10):\n        kids.append(os.fork())\n        if kids[-1] == 0:\n"
        "            import time; time.sleep(5)\nexcept OSError as e:\n    print(type(e).__name__, len(kids))",
        limits={"max_procs": 4},
    )
    assert procs.stdout.strip() in {"BlockingIOError 3", "BlockingIOError 4"}, procs
    files = await pool.run("open('f', 'wb').write(b'x' * (3 * 2**20))", limits={"file_size_mb": 2})
    assert files.status == Status.RUNTIME_ERROR and "File too large" in files.message


@session_loop
async def test_cell_semantics(pool):
    r = await pool.run("x = 6\nx * 7")
    assert r.stdout == "42\n", "the last expression is echoed when nothing was printed"
    r = await pool.run("print('shown')\n41 + 1")
    assert r.stdout == "shown\n", "no echo once something was printed"
    r = await pool.run("import random, numpy as np\nprint(random.random(), np.random.rand())")
    r2 = await pool.run("import random, numpy as np\nprint(random.random(), np.random.rand())")
    assert r.stdout != r2.stdout, "every call reseeds the RNGs"
    r = await pool.run("def f():\n    return undefined_name\nf()")
    assert r.stderr.count('File "<cell>"') == 2 and "NameError" in r.message
    r = await pool.run("import sympy\nsympy.sympify('x +* 2')")
    assert r.status == Status.RUNTIME_ERROR and "site-packages" not in r.stderr and "/work" not in r.stderr


THREADS_AND_FORKS = """
import os, random, threading, concurrent.futures as cf
assert threading.current_thread() is threading.main_thread()
with cf.ThreadPoolExecutor(4) as ex:
    squares = sorted(ex.map(lambda v: v * v, range(8)))
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, repr(random.random()).encode())
    os._exit(0)
os.close(w)
child_draw = float(os.read(r, 64))
os.waitpid(pid, 0)
print(squares[-1], threading.active_count(), child_draw != random.random())
"""


@session_loop
async def test_a_call_is_an_ordinary_python_process(pool):
    """The fork server forks without Python's at-fork hooks (linux.fork_bare): threads, thread pools and
    the user's own forks (which do run the hooks, so the child reseeds) must still behave as usual."""
    for _ in range(2):
        r = await pool.run(THREADS_AND_FORKS)
        assert (r.status, r.stdout) == (Status.OK, "49 1 True\n"), r


@session_loop
async def test_slots_recycle_and_recover_from_a_dead_zygote():
    """A zygote asks to be replaced after max_calls; one that dies mid-call is a sandbox_error, then replaced."""
    import asyncio
    import os
    import signal
    import time

    async with Sandbox(slots=1, max_calls=3, preload=[], warmup=[]) as sb:
        first = sb._slots[0].proc.pid
        assert [(await sb.run(f"print({i})")).stdout for i in range(4)] == ["0\n", "1\n", "2\n", "3\n"]
        assert sb._slots[0].proc.pid != first, "the zygote was recycled after 3 calls"
        call = asyncio.create_task(sb.run("import time; time.sleep(3)"))
        while not sb.health()["busy"]:  # the call holds the slot (the test's timeout guards a hang)
            await asyncio.sleep(0.01)
        os.kill(sb._slots[0].proc.pid, signal.SIGKILL)
        r = await call
        assert r.status == Status.SANDBOX_ERROR and r.is_infra_error and "died" in r.message
        assert (await sb.run("print('recovered')")).stdout == "recovered\n"
        assert sb.health()["alive"] == 1
        zygote = sb._slots[0].proc.pid
        deadline = time.monotonic() + 120  # a hang guard: SIGKILL delivery may lag on a loaded machine
        while time.monotonic() < deadline:
            # (it is reparented to the host's init, which reaps it: a zombie until then is dead already)
            strays = set(processes_of_uids(set(sb.uids), include_zombies=False)) - set(
                children(fork_server(zygote))
            )
            if not strays:
                break
            await asyncio.sleep(0.05)
        assert not strays, "the killed zygote's call must die with it"


@session_loop
async def test_cgroup_memory_limit_catches_what_rlimit_as_cannot(pool):
    """tmpfs pages are not address space: only the cgroup sees them (skipped where cgroups are missing)."""
    if not pool.features()["active"]["cgroup_memory"]:
        pytest.skip("no memory cgroup on this machine: RLIMIT_AS is the only memory limit")
    code = "open('big', 'wb').write(b'x' * (50 << 20))\nimport numpy as np\na = np.ones(7_000_000)\nprint(a.sum())"
    r = await pool.run(code, limits={"memory_mb": 64}, timeout=20)
    assert r.status == Status.MEMORY_LIMIT and r.message == "MemoryError: memory limit is 64 MiB", r
    assert r.signal == 9


def test_cells_are_routed_by_their_imports():
    assert stdlib_only("print(1)") and stdlib_only("import os, math as m\nfrom fractions import Fraction")
    for heavy in (
        "import numpy as np",
        "from sympy import *",
        "x = 1; import scipy",
        "def f():\n    import numpy",
    ):
        assert not stdlib_only(heavy), heavy
    assert not stdlib_only("__import__('numpy')"), "a dynamic import goes to the zygote that has everything"


LANE_CASES = (
    "print(sum(range(10)))",
    "x = 6\nx * 7",
    "def f():\n    return 1 / 0\nf()",
    "print('a'\n",
    "import sys\nprint('bye')\nsys.exit(3)",
    "x = bytearray(400 * 2**20)",
    "open('/etc/tirl-probe', 'w')",
    "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)",
    "import os\nprint(os.getcwd(), sorted(os.listdir('.')), os.getpid())",
)


@session_loop
async def test_light_and_heavy_zygotes_give_identical_results(pool):
    """A stdlib cell runs in the slot's light zygote; the heavy one must answer it the same way."""
    slot = await pool._idle.get()
    try:
        assert slot.light is not None and slot.lane_for(LANE_CASES[0]) is slot.light
        limits = pool.call_limits()
        for code in LANE_CASES:
            (light, _), (heavy, _) = [await pool._call(lane, code, "", limits) for lane in (slot.light, slot)]
            fields = ("status", "stdout", "stderr", "message", "exit_code", "signal")
            assert [getattr(light, f) for f in fields] == [getattr(heavy, f) for f in fields], code
    finally:
        pool._idle.put_nowait(slot)


@session_loop
async def test_a_dead_light_zygote_is_replaced_while_its_slot_keeps_serving():
    import os
    import signal

    async with Sandbox(slots=1, preload=["json", "numpy"], warmup=[]) as sb:
        slot = sb._slots[0]
        assert slot.light.config["preload"] == ["json"], "the light twin loads only the stdlib part"
        first = slot.light.proc.pid
        os.kill(first, signal.SIGKILL)
        r = await sb.run("print(1)")
        assert r.status == Status.SANDBOX_ERROR and "died" in r.message
        r2 = await sb.run("import numpy\nprint(2)")
        assert r2.stdout == "2\n", (r2.status, r2.message)
        assert (await sb.run("print(3)")).stdout == "3\n" and slot.light.proc.pid != first
        assert sb.health()["alive"] == 1 and len(sb.uids) == 2


async def test_live_pools_never_share_uids_however_many_were_created():
    """Uid ranges (and the cgroups named after them) are machine-wide: a wrap-around onto a live pool broke it."""
    from tirl.sandbox import pool as pool_module

    async with Sandbox(slots=1, preload=[], warmup=[]) as alive:
        free = pool_module.POOLS_PER_PROCESS - len(pool_module._live_pool_indices)
        claimed = [pool_module._claim_pool_index() for _ in range(free)]
        try:
            assert alive._pool_index not in claimed
            with pytest.raises(RuntimeError, match="pools alive in one process"):
                pool_module._claim_pool_index()
        finally:
            pool_module._live_pool_indices.difference_update(claimed)
        assert (await alive.run("print(1)")).stdout == "1\n"
    assert alive._pool_index not in pool_module._live_pool_indices  # released on close
