"""Persistent Python sessions: state across calls, same isolation, clear loss, nothing left behind."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from tirl.sandbox import Sandbox, Status
from tirl.sandbox.cgroups import PREFIX, _own_paths

from .hostcheck import open_fds, processes_of_uids, rss_pages, wait_idle, zygote_pids

session_loop = pytest.mark.asyncio(loop_scope="session")

CELLS = [
    ("import math\nx = 41\ndef f(y):\n    return y + x", ""),
    ("print(f(1), math.floor(2.5))", "42 2\n"),
    ("data = input()\nf(len(data))", "46\n"),
]


@session_loop
async def test_state_is_kept_across_calls_in_process(pool):
    async with await pool.open_session() as session:
        for i, (code, expected) in enumerate(CELLS):
            r = await session.run(code, stdin="abcde\n")
            assert (r.status, r.stdout) == (Status.OK, expected), (i, r)
        r = await session.run(
            "import os\nprint(os.getuid() > 0, os.getpid(), os.path.exists('/work/shared'))"
        )
        assert r.stdout == "True 1 False\n", "a session is confined like any call"
        pid = session.child.pid
    deadline = time.monotonic() + 120  # reaped by its fork server (a hang guard, not a time limit)
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.025)
    assert not Path(f"/proc/{pid}").exists(), "a closed session's process must be gone"
    r = await session.run("print(x)")
    assert r.status == Status.RUNTIME_ERROR and "session is gone" in r.message and "closed" in r.message, r


@session_loop
async def test_state_is_kept_across_calls_over_http(service):
    session = await service.open_session()
    for i, (code, expected) in enumerate(CELLS):
        r = await session.run(code, stdin="abcde\n")
        assert (r.status, r.stdout) == (Status.OK, expected), (i, r)
    await session.aclose()
    r = await session.run("print(x)")
    assert (
        r.status == Status.RUNTIME_ERROR and r.extra.get("session_lost") and "no live session" in r.message
    ), r


@session_loop
async def test_a_lost_session_says_why(pool):
    session = await pool.open_session({"memory_mb": 128})
    assert (await session.run("keep = 1")).status == Status.OK
    r = await session.run("import os\nblob = bytearray(os.urandom(1 << 20)) * 400", timeout=20)
    assert r.status == Status.MEMORY_LIMIT, r
    r = await session.run("keep", timeout=20)
    # a MemoryError inside Python keeps the session; a kernel OOM kill loses it, and says so
    assert (r.status, r.stdout) == (Status.OK, "1\n") or "memory" in r.message, r
    r = await session.run("while True: pass", timeout=1)
    assert r.status == Status.TIMEOUT and "session was lost" in r.message, r
    r = await session.run("keep")
    assert r.status == Status.RUNTIME_ERROR and "timed out" in r.message and "open a new session" in r.message
    await session.aclose()


def _session_cgroups() -> list[str]:
    """This process's sandbox cgroups, in every hierarchy."""
    found = []
    for controller, path in _own_paths().items():
        base = Path("/sys/fs/cgroup", controller, path.lstrip("/"))
        found += [str(p) for p in base.glob(f"{PREFIX}*-{os.getpid()}")]
    return sorted(found)


@session_loop
async def test_abandoned_sessions_leave_nothing_behind():
    """200 sessions opened, used and abandoned: idle expiry ends each; no process, fd, cgroup or memory stays."""
    async with Sandbox(slots=1, preload=[], warmup=[], max_sessions=64, session_idle_s=1.0) as sb:
        zygotes = zygote_pids(os.getpid())

        async def round_(n: int) -> None:
            for i in range(n):  # opened, used once, never closed
                session = await sb.open_session()
                r = await session.run(f"v = {i}\nprint(v * 2)")
                assert (r.status, r.stdout) == (Status.OK, f"{2 * i}\n"), r
            deadline = time.monotonic() + 120  # abandoned: the pool's idle expiry must end them
            while sb._sessions and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not sb._sessions, "idle sessions were not expired"

        await round_(20)  # warm: allocator arenas, the session zygote (and its cgroup)
        groups_before = set(_session_cgroups())
        fds, rss = open_fds(os.getpid()), rss_pages(os.getpid())
        for _ in range(9):
            await round_(20)
        wait_idle([z for z in zygote_pids(os.getpid()) if z in zygotes] or zygotes)
        assert open_fds(os.getpid()) <= fds, "session pipes or pidfds leaked"
        assert rss_pages(os.getpid()) - rss < 64 * 256, "the pool's memory grew with abandoned sessions"
        live = set(processes_of_uids(set(sb.uids) | set(sb.session_uids), include_zombies=True))
        assert len(live) <= 1, f"session processes outlived their sessions: {live}"  # only the prepared child
        assert set(_session_cgroups()) <= groups_before, "session cgroups were left behind"


@session_loop
async def test_a_session_cannot_meet_other_calls_or_sessions(pool):
    """Each session has its own uid and network namespace: what it leaves listening reaches no one."""
    name = f"tirl-{os.getpid()}-session"
    listen = f"import os, socket\ns = socket.socket(socket.AF_UNIX)\ns.bind('\\0{name}')\ns.listen()\nprint(os.getuid())"
    connect = (
        f"import os, socket\nc = socket.socket(socket.AF_UNIX)\ntry:\n    c.connect('\\0{name}')\n    print('met')\n"
        "except OSError as e:\n    print(type(e).__name__)\nprint(os.getuid())"
    )
    async with await pool.open_session() as first, await pool.open_session() as second:
        r = await first.run(listen)
        assert r.status == Status.OK, r
        first_uid = int(r.stdout)
        others = [await second.run(connect)] + [await pool.run(connect) for _ in range(2)]  # both slots
        for o in others:
            refused, uid = o.stdout.split()
            assert refused == "ConnectionRefusedError", o
            assert int(uid) != first_uid, "a session must not share its uid with other code"


SPIN = "import threading\nticks = [0]\ndef spin():\n    while True:\n        ticks[0] += 1\nthreading.Thread(target=spin, daemon=True).start()"
FORGED_END = "import os\nos.write(3, b'\\x00done\\n')\nwhile True:\n    pass"


@session_loop
async def test_nothing_of_a_session_runs_between_its_cells(pool):
    """A thread a cell leaves spinning, or a cell that forges the in-band end-of-cell marker to return
    early, used to keep computing (up to the idle expiry) outside any slot, taking the CPU the
    slots' calls were promised. Between cells the session is frozen; it resumes in its next cell."""
    if not pool.features()["active"]["cgroup_cpu_quota"]:
        pytest.skip("no cgroups here: sessions cannot be frozen between cells")
    async with await pool.open_session() as session:
        assert (await session.run(SPIN)).status == Status.OK
        used = session.cgroup.cpu_ns()
        await asyncio.sleep(1.0)  # room for a leak to show: the assertion is on CPU, not on time
        assert session.cgroup.cpu_ns() - used < 20e6, "the spinning thread ran between cells"
        r = await session.run("ticks[0] > 0")
        assert (r.status, r.stdout) == (Status.OK, "True\n"), "it resumes within the session's cells"
    async with await pool.open_session() as session:
        r = await session.run(FORGED_END, timeout=2)
        assert r.status == Status.OK and not r.stdout, r  # what the forger got: an early, empty 'ok'
        used = session.cgroup.cpu_ns()
        await asyncio.sleep(1.0)
        assert session.cgroup.cpu_ns() - used < 20e6, "the forged cell ran on after 'ending'"
        r = await session.run("print('next')", timeout=2)
        assert r.status == Status.TIMEOUT and r.extra.get("session_lost"), "its next cell pays for it"
