"""Persistent Python sessions: state across calls, same isolation, clear loss, nothing left behind; then
a session's protocol over stand-in pipes and the pool's session admission (see docs/mutation.md)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import time
import types
from pathlib import Path

import pytest

import tirl.sandbox.session as sm
from tirl.sandbox import Sandbox, Status, forkserver, framing
from tirl.sandbox.admission import Admission, SessionError
from tirl.sandbox.cgroups import PREFIX, _own_paths
from tirl.sandbox.limits import Limits
from tirl.sandbox.pool import SESSION_UIDS
from tirl.sandbox.session import Session, gone
from tirl.sandbox.session_manager import SessionManager

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
    # A short expiry only shortens each round's wait: the reaper skips a session whose lock a cell holds,
    # and each cell below takes it as open_session returns (no await between), so none loses its session.
    async with Sandbox(slots=1, preload=[], warmup=[], max_sessions=64, session_idle_s=0.3) as sb:
        zygotes = zygote_pids(os.getpid())

        async def round_(n: int) -> None:
            for i in range(n):  # opened, used once, never closed
                session = await sb.open_session()
                r = await session.run(f"v = {i}\nprint(v * 2)")
                assert (r.status, r.stdout) == (Status.OK, f"{2 * i}\n"), r
            deadline = time.monotonic() + 120  # abandoned: the pool's idle expiry must end them
            while sb.sessions.live and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not sb.sessions.live, "idle sessions were not expired"

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


# ---- a session's protocol with a stand-in process made of pipes, no sandbox: the set-up handshake,
# each cell's outcome and message, what loses the session (timeout, output cap, exit, memory) and what
# every later call says, the freezer around cells, and close; then the pool's session admission: the
# cap, uids taken lowest-first, released on close and reused ----

# Stand-in pipes answer at once: 20 s is a hang, not load.
PIPES_ONLY = pytest.mark.timeout(20)


class FakeCgroup:
    def __init__(self):
        self.frozen: list[bool] = []
        self.ooms = 0
        self.closed = 0

    def freeze(self, frozen: bool) -> None:
        self.frozen.append(frozen)

    def oom_kills(self) -> int:
        return self.ooms

    def close(self) -> None:
        self.closed += 1

    def dirs(self) -> list[str]:
        return []


class Process:
    """The far ends of a session's pipes: what the runner would read and write."""

    def __init__(self):
        self.req_r, req_w = os.pipe()
        out_r, self.out_w = os.pipe()
        err_r, self.err_w = os.pipe()
        res_r, self.res_w = os.pipe()
        pid_r, self.pid_w = os.pipe()  # readable once the "process" exits
        self.child = forkserver.Prepared(
            pid=-1, pidfd=pid_r, request=req_w, stdout=out_r, stderr=err_r, result=res_r
        )
        self.signals: list[int] = []

    def write(self, stdout: bytes = b"", stderr: bytes = b"", result: bytes = b"") -> None:
        for fd, data in ((self.out_w, stdout), (self.err_w, stderr), (self.res_w, result)):
            if data:
                os.write(fd, data)

    def report(self, **info) -> None:
        self.write(result=json.dumps(info).encode() + b"\n" + forkserver.SESSION_DONE)

    def exit(self) -> None:
        os.write(self.pid_w, b"x")

    def request(self) -> object:
        return framing.read_frame(self.req_r)

    def close(self) -> None:
        for fd in (self.req_r, self.out_w, self.err_w, self.res_w, self.pid_w):
            with contextlib.suppress(OSError):
                os.close(fd)


@pytest.fixture
def proc(monkeypatch):
    p = Process()

    def kill(fd, sig):
        p.signals.append(sig)
        p.exit()

    monkeypatch.setattr(sm.signal, "pidfd_send_signal", kill)
    yield p
    p.close()


def session(proc: Process, started: bool = True, **limits) -> Session:
    if started:  # what start() set: the session's pipes never block the event loop
        for fd in (proc.child.request, proc.child.stdout, proc.child.stderr, proc.child.result):
            os.set_blocking(fd, False)
    return Session(Limits(**limits), proc.child, FakeCgroup())


LOST = ": its variables are gone; open a new session)"


@PIPES_ONLY
async def test_start_sends_the_session_request_and_freezes_it_when_ready(proc):
    s = session(proc, started=False, timeout_s=3)
    proc.write(result=forkserver.STARTED + forkserver.SESSION_DONE)
    r = await s.start(Limits(timeout_s=7))
    assert r.status == Status.OK and s.alive and r.extra["session"] == s.id
    req = proc.request()
    assert req == {"session": True, "code": "", "stdin": "", "limits": Limits(timeout_s=7).model_dump()}
    assert s.cgroup.frozen == [True] and proc.signals == []
    for fd in (proc.child.request, proc.child.stdout, proc.child.stderr, proc.child.result):
        assert os.get_blocking(fd) is False


@PIPES_ONLY
@pytest.mark.parametrize(
    "raw", [b"", forkserver.SESSION_DONE, forkserver.STARTED, b"junk" + forkserver.STARTED]
)
async def test_a_session_that_does_not_start_is_lost(proc, raw):
    s = session(proc, started=False, timeout_s=0.2)
    if raw:
        proc.write(result=raw)
    proc.exit()
    r = await s.start(Limits())
    assert r.status == Status.SANDBOX_ERROR and r.message == "sandbox error: the session failed to start"
    assert s.lost == "it failed to start" and not s.alive
    assert True not in s.cgroup.frozen  # a lost session is not frozen
    assert "session_lost" not in r.extra


@PIPES_ONLY
async def test_a_cell_runs_thawed_and_returns_its_output(proc):
    s = session(proc)
    proc.write(stdout=b"hello\n", stderr=b"warn\n")
    proc.report(outcome="ok")
    before = s.last_used
    r = await s.run_cell("print('hello')", "in", 5.0)
    assert (r.status, r.stdout, r.stderr, r.message) == (Status.OK, "hello\n", "warn\n", "")
    assert proc.request() == {"code": "print('hello')", "stdin": "in"}
    assert s.cgroup.frozen == [False, True] and s.calls == 1 and s.last_used >= before
    assert r.extra == {
        "stdout_bytes": 6,
        "stderr_bytes": 5,
        "keep_bytes": s.limits.keep_bytes,
        "session": s.id,
    }
    assert r.wall_ms >= 0 and s.alive and proc.signals == []


@PIPES_ONLY
async def test_cell_outcomes_and_their_messages(proc):
    s = session(proc)
    cases = [
        ({"outcome": "error", "error": "ZeroDivisionError: x"}, Status.RUNTIME_ERROR, "ZeroDivisionError: x"),
        ({"outcome": "error"}, Status.RUNTIME_ERROR, "error"),
        ({"outcome": "syntax_error", "error": "SyntaxError: bad"}, Status.SYNTAX_ERROR, "SyntaxError: bad"),
        ({"outcome": "syntax_error"}, Status.SYNTAX_ERROR, "SyntaxError"),
        ({"outcome": "memory_error"}, Status.MEMORY_LIMIT, "MemoryError: memory limit is 1 GiB"),
        ({"outcome": "exit", "exit_code": 3}, Status.RUNTIME_ERROR, "exited with code 3"),
        ({"outcome": "exit", "exit_code": "x"}, Status.RUNTIME_ERROR, "exited with code 1"),
        ({"outcome": "exit", "exit_code": 0}, Status.OK, ""),
        ({"outcome": "exit"}, Status.OK, ""),
        ({"outcome": "ok"}, Status.OK, ""),
    ]
    for info, status, message in cases:
        proc.report(**info)
        r = await s.run_cell("x", "", 5.0)
        assert (r.status, r.message) == (status, message), info
        assert s.alive and "session_lost" not in r.extra
    assert s.calls == len(cases)
    proc.report(outcome="error", error="OSError", network=True)
    assert (await s.run_cell("x", "", 5.0)).extra["network_blocked"] is True
    proc.report(outcome="error", error="OSError", network=1)
    assert "network_blocked" not in (await s.run_cell("x", "", 5.0)).extra
    proc.report(outcome="exit", exit_code=2)
    assert (await s.run_cell("x", "", 5.0)).exit_code == 2


@PIPES_ONLY
async def test_the_last_report_counts(proc):
    s = session(proc)
    proc.write(result=json.dumps({"outcome": "error", "error": "E"}).encode() + b"\n")
    proc.report(outcome="ok")
    assert (await s.run_cell("x", "", 5.0)).status == Status.OK


@PIPES_ONLY
async def test_a_timed_out_cell_loses_the_session_and_later_calls_say_so(proc):
    s = session(proc)
    r = await s.run_cell("while True: pass", "", 0.2)
    assert r.status == Status.TIMEOUT
    assert r.message == "Timed out after 0.2 s; the session was lost (its cell timed out after 0.2 s" + LOST
    assert r.extra["session_lost"] is True and s.lost == "its cell timed out after 0.2 s"
    assert proc.signals and s.exited
    assert s.cgroup.frozen[-1] is False  # thawed to be killed, never frozen again
    again = await s.run_cell("x", "", 5.0)
    assert again == gone("its cell timed out after 0.2 s") and s.calls == 1


@PIPES_ONLY
async def test_the_default_timeout_is_the_limits(proc):
    s = session(proc, timeout_s=0.3)
    r = await s.run_cell("x", "", 0)
    assert r.status == Status.TIMEOUT and r.message.startswith("Timed out after 0.3 s")


@PIPES_ONLY
async def test_output_beyond_the_cap_loses_the_session(proc):
    s = session(proc, output_bytes=1024)
    proc.write(stdout=b"a" * 600, stderr=b"b" * 300, result=b"c" * 200)  # 1100 > 1024, the result pipe too
    r = await s.run_cell("x", "", 5.0)
    assert r.status == Status.OUTPUT_LIMIT
    assert r.message == (
        "output limit exceeded (cap 1 KiB); the session was lost (its cell exceeded the output limit" + LOST
    )
    assert s.lost == "its cell exceeded the output limit" and proc.signals


@PIPES_ONLY
async def test_output_at_exactly_the_cap_is_kept(proc):
    s = session(proc, output_bytes=1024)
    report = json.dumps({"outcome": "ok"}).encode() + b"\n" + forkserver.SESSION_DONE
    proc.write(stdout=b"a" * (1024 - len(report)))
    proc.write(result=report)
    r = await s.run_cell("x", "", 5.0)
    assert r.status == Status.OK and s.alive


@PIPES_ONLY
async def test_a_process_that_exits_mid_cell_loses_the_session(proc):
    s = session(proc)
    proc.write(stdout=b"partial")
    proc.exit()
    r = await s.run_cell("import os; os._exit(0)", "", 5.0)
    assert (r.status, r.stdout) == (Status.RUNTIME_ERROR, "partial")
    assert r.message == "the session's process exited (its process exited" + LOST
    assert s.lost == "its process exited" and s.exited  # known gone: closing it waits for nothing


@PIPES_ONLY
async def test_a_process_killed_for_memory_says_so(proc):
    s = session(proc, memory_mb=64)
    s.cgroup.ooms = 0
    proc.exit()

    def oom_after():  # the kernel counts the kill while the cell runs
        s.cgroup.ooms = 1
        return 0

    s.cgroup.oom_kills = lambda: s.cgroup.ooms if s.cgroup.ooms else oom_after()
    r = await s.run_cell("x = ' ' * 10**10", "", 5.0)
    assert r.status == Status.MEMORY_LIMIT
    assert r.message == (
        "MemoryError: memory limit is 64 MiB; the session was lost (it was killed for exceeding its memory limit"
        + LOST
    )


@PIPES_ONLY
async def test_a_marker_in_the_output_before_the_request_ends_nothing_early(proc):
    s = session(proc, timeout_s=0.3)
    proc.write(stdout=forkserver.SESSION_DONE)  # the marker counts only on the result pipe
    r = await s.run_cell("x", "", 0.3)
    assert r.status == Status.TIMEOUT


@PIPES_ONLY
async def test_a_cancelled_cell_loses_the_session(proc):
    s = session(proc)
    task = asyncio.create_task(s.run_cell("x", "", 5.0))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert s.lost == "its cell was interrupted" and proc.signals
    assert (await s.run_cell("x", "", 1.0)).message == (
        "this Python session is gone (its cell was interrupted): its variables are lost; open a new session"
    )


@PIPES_ONLY
async def test_close_kills_frees_and_keeps_the_first_reason(proc):
    s = session(proc)
    await s.close("it was idle")
    assert s.lost == "it was idle" and proc.signals == [9]
    assert proc.child.pidfd == -1 and s.cgroup.closed == 1 and s.exited
    await s.close("again")
    assert s.lost == "it was idle" and s.cgroup.closed == 1
    assert await s.run_cell("x", "", 1.0) == gone("it was idle")


@PIPES_ONLY
async def test_close_default_reason_and_a_closed_child(proc):
    s = session(proc)
    s.child.close()
    await s.close()
    assert s.lost == "it was closed" and s.cgroup.closed == 0
    assert await s.run_cell("x", "", 1.0) == gone("it was closed")


@PIPES_ONLY
def test_gone_says_the_session_is_lost():
    r = gone("why")
    assert r.status == Status.RUNTIME_ERROR and r.extra == {"session_lost": True}
    assert r.message == "this Python session is gone (why): its variables are lost; open a new session"


@PIPES_ONLY
async def test_run_and_close_go_through_the_owner(proc):
    calls = []

    class Owner:
        async def run_in_session(self, s, code, stdin, timeout):
            calls.append(("run", s, code, stdin, timeout))
            return "result"

        async def close_session(self, s):
            calls.append(("close", s))

    s = session(proc)
    s.owner = Owner()
    async with s as same:
        assert same is s
        assert await s.run("c", "i", 2.0) == "result"
        assert await s.run("d") == "result"
    assert calls == [("run", s, "c", "i", 2.0), ("run", s, "d", "", None), ("close", s)]
    assert s.id and s.id != session(proc).id and s.uid_index == 0 and not s.released


@pytest.fixture
async def loop_errors() -> list[dict]:
    """What the event loop reports from its callbacks (a session's pipe callbacks must never fail)."""
    errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
    return errors


def fake_clock(monkeypatch, now: float) -> types.SimpleNamespace:
    """The session module's clock, set by hand (the event loop keeps the real one)."""
    clock = types.SimpleNamespace(now=now)
    monkeypatch.setattr(sm, "time", types.SimpleNamespace(monotonic=lambda: clock.now))
    return clock


@PIPES_ONLY
async def test_wall_time_is_the_cells_own_in_milliseconds_and_last_used_its_start_then_end(proc, monkeypatch):
    clock = fake_clock(monkeypatch, 100.0)
    s = session(proc)
    task = asyncio.create_task(s.run_cell("x", "", 5.0))
    await asyncio.sleep(0.02)
    assert not task.done() and s.last_used == 100.0  # a running cell counts as use from its start
    clock.now = 100.1234567
    proc.report(outcome="ok")
    r = await task
    assert r.wall_ms == 123.46 and s.last_used == 100.1234567


@PIPES_ONLY
async def test_a_slow_start_is_not_idle_time(proc, monkeypatch):
    clock = fake_clock(monkeypatch, 100.0)
    s = session(proc, started=False)
    clock.now = 130.0  # the interpreter took 30 s to come up: the idle reaper must not count them
    proc.write(result=forkserver.STARTED + forkserver.SESSION_DONE)
    assert (await s.start(Limits())).status == Status.OK
    assert s.last_used == 130.0


@PIPES_ONLY
async def test_the_addresses_a_cell_reports_come_back_as_a_list(proc):
    s = session(proc)
    proc.report(outcome="ok", addresses="0x7f3a1c2b4d10 0x7f3a1c2b4e50")
    r = await s.run_cell("print(object())", "", 5.0)
    assert r.status == Status.OK and r.extra["addresses"] == ["0x7f3a1c2b4d10", "0x7f3a1c2b4e50"]


@PIPES_ONLY
async def test_start_gives_the_interpreter_the_cell_timeout_plus_10_s(proc, monkeypatch):
    seen = []
    real = Session._exchange

    async def exchange(self, req, timeout, first=False):
        seen.append((timeout, first))
        return await real(self, req, timeout, first)

    monkeypatch.setattr(Session, "_exchange", exchange)
    s = session(proc, started=False, timeout_s=3)
    proc.write(result=forkserver.STARTED + forkserver.SESSION_DONE)
    assert (await s.start(Limits(timeout_s=50))).status == Status.OK
    assert seen == [(13, True)]


@PIPES_ONLY
async def test_a_session_whose_process_handles_are_closed_says_it_was_closed(proc):
    s = session(proc)
    s.child.close()
    assert await s.run_cell("x", "", 1.0) == gone("it was closed") and s.calls == 0


@PIPES_ONLY
async def test_truncated_output_counts_the_bytes_dropped(proc):
    s = session(proc, keep_bytes=256)
    proc.write(stdout=b"a" * 1000, stderr=b"b" * 700)
    proc.report(outcome="ok")
    r = await s.run_cell("x", "", 5.0)
    assert (r.stdout_truncated_bytes, r.stderr_truncated_bytes) == (1000 - 512, 700 - 512)
    assert r.extra["stdout_bytes"] == 1000 and r.extra["stderr_bytes"] == 700


@PIPES_ONLY
async def test_output_still_in_the_pipes_when_the_process_exits_is_kept(proc):
    s = session(proc, output_bytes=4 << 20)
    size = 900_000  # many reads' worth: most of it is still in the pipes when the exit is seen
    for fd in (proc.out_w, proc.err_w):
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)
    proc.write(stdout=b"o" * size, stderr=b"e" * size)
    proc.exit()
    r = await s.run_cell("x", "", 5.0)
    assert r.status == Status.RUNTIME_ERROR and s.lost == "its process exited" and s.exited
    assert (r.extra["stdout_bytes"], r.extra["stderr_bytes"]) == (size, size)
    assert r.stdout.endswith("o" * 100) and r.stderr.endswith("e" * 100)


@PIPES_ONLY
async def test_a_report_read_before_the_request_is_all_written_ends_the_cell_once_it_is(proc, loop_errors):
    s = session(proc)
    code = "x" * 300_000  # more than the request pipe holds: written as the process reads it
    proc.report(outcome="ok")
    task = asyncio.create_task(s.run_cell(code, "", 5.0))
    await asyncio.sleep(0.1)
    assert not task.done()  # the report came before the whole request: it ends nothing yet
    got = bytearray()
    loop = asyncio.get_running_loop()
    loop.add_reader(proc.req_r, lambda: got.extend(os.read(proc.req_r, 1 << 16)))
    try:
        r = await asyncio.wait_for(task, 3)
    finally:
        loop.remove_reader(proc.req_r)
    assert r.status == Status.OK and s.alive and loop_errors == []
    assert bytes(got) == framing.encode({"code": code, "stdin": ""})


@PIPES_ONLY
async def test_a_stream_the_process_closes_is_no_longer_watched(proc, loop_errors):
    s = session(proc)
    os.close(proc.out_w)
    proc.out_w = -1
    proc.write(stderr=b"e")
    task = asyncio.create_task(s.run_cell("x", "", 5.0))
    await asyncio.sleep(0.05)
    proc.report(outcome="ok")
    r = await task
    assert (r.status, r.stdout, r.stderr) == (Status.OK, "", "e") and loop_errors == []


@PIPES_ONLY
async def test_output_of_exactly_the_cap_before_the_report_is_kept(proc):
    s = session(proc, output_bytes=1024)
    proc.write(stdout=b"a" * 1024)
    task = asyncio.create_task(s.run_cell("x", "", 5.0))
    await asyncio.sleep(0.05)  # read, at the cap: not over it
    assert not task.done()
    proc.report(outcome="ok")
    r = await task
    assert r.status == Status.OK and s.alive


@PIPES_ONLY
@pytest.mark.parametrize("before", [0, 1 << 16])
async def test_the_end_marker_counts_within_the_last_64_bytes_read(proc, before):
    """The marker ends a cell when it is among the last 64 bytes read from the result pipe (the head's
    end while the result is short, the tail's once it passed the 64 KiB head): the runner writes it
    last; one followed by more bytes was forged mid-cell."""
    s = session(proc)
    report = json.dumps({"outcome": "error", "error": "E"}).encode() + b"\n" + forkserver.SESSION_DONE
    filler = b"r" * (before - 1) + b"\n" if before else b""
    for trailing, ends in (
        (64 - len(forkserver.SESSION_DONE), True),
        (65 - len(forkserver.SESSION_DONE), False),
    ):
        proc.write(result=filler)
        task = asyncio.create_task(s.run_cell("x", "", 0.3))
        await asyncio.sleep(0.02)
        proc.write(result=report + b"t" * trailing)
        r = await task
        assert (r.status == Status.TIMEOUT) is not ends, (trailing, r)
        if ends:
            assert (r.status, r.message) == (Status.RUNTIME_ERROR, "E") and s.alive


# ---- the session manager's admission (no zygote started) ----


def admission_manager(max_sessions: int, memory_mb: int = 10_000) -> SessionManager:
    rule = Admission(max_queue=8, max_sessions=max_sessions, budget_mb=memory_mb, calls_reserve_mb=0)
    return SessionManager(None, rule, first_uid=None, uids=SESSION_UIDS, idle_s=600.0, cpu_s=3600.0)  # type: ignore[arg-type]


@PIPES_ONLY
def test_session_uids_are_taken_lowest_first_released_on_close_and_reused():
    manager = admission_manager(3)
    limits = Limits(memory_mb=100)
    assert [manager._admit(limits) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(SessionError) as err:
        manager._admit(limits)
    assert (
        str(err.value)
        == "3 sessions are live or opening (the cap): close some, or wait for idle ones to expire"
    )
    manager._release_held(1, 100)
    assert manager.admission.sessions_held == 2 and manager.admission.sessions_mb == 200
    assert manager._admit(limits) == 1  # the freed uid, not a new one
    manager._release_held(0, 100)
    manager._release_held(2, 100)
    assert manager._admit(limits) == 0 and manager.uids_in_use == {0, 1}


@PIPES_ONLY
def test_a_session_is_released_once():
    manager = admission_manager(2)
    s = Session(Limits(memory_mb=64), forkserver.Prepared(-1, -1, -1, -1, -1, -1), FakeCgroup(), uid_index=0)
    s.uid_index = manager._admit(s.limits)
    manager._release(s)
    manager._release(s)
    rule = manager.admission
    assert s.released and rule.sessions_held == 0 and rule.reserved_mb == 0 and manager.uids_in_use == set()


@PIPES_ONLY
def test_a_closed_pool_opens_no_session():
    manager = admission_manager(2)
    manager.admission.closed = True
    with pytest.raises(SessionError) as err:
        manager._admit(Limits())
    assert str(err.value) == "the sandbox pool is closed"
    assert manager.admission.sessions_held == 0 and SESSION_UIDS >= 64


@PIPES_ONLY
def test_a_session_beyond_the_memory_budget_is_refused_and_holds_nothing():
    manager = admission_manager(3, memory_mb=150)
    assert manager._admit(Limits(memory_mb=100)) == 0
    with pytest.raises(SessionError) as err:
        manager._admit(Limits(memory_mb=100))
    assert str(err.value) == (
        "memory budget: sessions hold 100 of the 150 MiB they may share (0 of 150 MiB are kept for "
        "stateless calls), 100 MiB more do not fit (close idle sessions, or ask for less memory)"
    )
    rule = manager.admission
    assert rule.sessions_held == 1 and manager.uids_in_use == {0} and rule.reserved_mb == 100


@PIPES_ONLY
async def test_killing_signals_the_sessions_pidfd_and_a_process_already_gone_is_fine(proc, monkeypatch):
    sent = []

    def kill(fd, sig):
        sent.append((fd, sig))
        proc.exit()
        raise ProcessLookupError("already gone")

    monkeypatch.setattr(sm.signal, "pidfd_send_signal", kill)
    s = session(proc)
    pidfd = s.child.pidfd
    r = await s.run_cell("while True: pass", "", 0.2)
    assert r.status == Status.TIMEOUT and s.exited
    await s.close()
    assert sent == [(pidfd, 9), (pidfd, 9)] and s.cgroup.closed == 1


@PIPES_ONLY
async def test_a_process_that_survives_its_kill_costs_a_bounded_wait_and_close_still_frees(proc, monkeypatch):
    """The hang guards: a killed process that does not exit (a stuck kernel) and an exchange that never
    lets go are each waited for EXIT_WAIT_S at most; close() frees the session's handles anyway."""
    monkeypatch.setattr(sm, "EXIT_WAIT_S", 0.1)
    monkeypatch.setattr(sm.signal, "pidfd_send_signal", lambda fd, sig: proc.signals.append(sig))  # no exit
    s = session(proc)
    r = await asyncio.wait_for(s.run_cell("while True: pass", "", 0.2), 5)
    assert r.status == Status.TIMEOUT and not s.exited
    s._quiet.clear()  # as if an exchange still held the pipes
    await asyncio.wait_for(s.close(), 5)
    assert s.cgroup.closed == 1 and proc.child.pidfd == -1 and proc.signals == [9, 9]


@PIPES_ONLY
async def test_close_retries_removing_the_cgroup_until_it_is_gone(proc, monkeypatch, tmp_path):
    group = tmp_path / "slot"
    group.mkdir()
    calls = []

    def remove(groups):
        calls.append(groups)
        if len(calls) == 3:  # busy twice (its processes are still being reaped), then empty
            group.rmdir()

    monkeypatch.setattr(sm.cgroups, "remove_slot_cgroups", remove)
    s = session(proc)
    s.cgroup.dirs = lambda: [str(group)]
    loop = asyncio.get_running_loop()
    start = loop.time()
    await s.close()
    assert len(calls) == 3 and calls[0] == [s.cgroup] and not group.exists()
    assert loop.time() - start < 1.0  # retried every 10 ms, not every second
