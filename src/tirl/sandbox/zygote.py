"""The warm zygote of one slot: imports once, then splits into a fork server and a supervisor.

Started by the pool as `python -m tirl.sandbox.zygote`; talks frames on its original stdin/stdout.
It enters the slot's long-lived namespaces and allowlisted root, pre-imports numpy/sympy/scipy and
the error-path stdlib, and runs warm-up cells in itself (so lazy imports and caches are inherited
by every fork). Then, before any call exists, it forks its fork server (forkserver.py), which
forks and confines each call's process; this process stays the slot's supervisor: it moves each
call's request and output bytes, enforces its deadline and output cap, and classifies how it
ended. The process that forks user code therefore never holds any call's data (a call cannot
read an earlier call's code, stdin or output from its own memory). The next call's process is
prepared while the pool handles the previous reply, so a call's latency is mostly the user's code.
The supervisor asks to be recycled after `max_calls` calls or when its memory grew by
`max_growth_mb`.
"""

from __future__ import annotations

import gc
import importlib
import io
import itertools
import json
import os
import signal
import socket
import sys
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tirl import linux
from tirl.sandbox import capture, cell, forkserver, framing, isolation
from tirl.sandbox.isolation import MiB
from tirl.sandbox.result import ExecResult, Status, human_bytes

if TYPE_CHECKING:
    from tirl.sandbox.limits import Limits

PRELOAD = ("numpy", "sympy", "scipy", "scipy.optimize", "scipy.special", "scipy.linalg", "fractions",
           "decimal", "itertools", "functools", "collections", "math", "cmath", "statistics", "random",
           "re", "heapq", "bisect", "string", "json", "traceback", "linecache", "tokenize", "ast",
           "warnings", "numbers", "datetime")  # fmt: skip
WARMUP = (
    "import numpy as np\nnp.linalg.solve(np.eye(3), np.ones(3)).sum()",
    "import sympy as sp\nt = sp.Symbol('t')\nsp.simplify(sp.sin(t)**2 + sp.cos(t)**2), sp.solve(t**2 - 4, t)",
    "import sympy as sp\nsp.Rational(3, 7) + sp.sqrt(8), sp.isprime(97), sp.factorint(360)",
    "from fractions import Fraction\nfrom math import comb\nFraction(comb(10, 3), 7)",
    "1/0",
    "import scipy.optimize as so\nso.brentq(lambda v: v**3 - 2, 0, 2)",
)
ZYGOTE_HEADROOM = 32 * MiB  # the fork server shares its slot's memory cgroup with the call
# A timed-out call that got less than this share of a CPU while its threads waited to run for most
# of the wall time was starved by other processes: an infrastructure failure, not the code's.
STARVED_CPU_SHARE = 0.1
STARVED_WAIT_SHARE = 0.5


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _warm_up(modules: list[str], cells: list[str]) -> None:
    """Import `modules`, then run the warm-up cells that use only what is loaded (a lighter
    preload, e.g. for tests, must not be undone by the cells importing the heavy libraries)."""
    for name in modules:
        importlib.import_module(name)
    sink = io.StringIO()
    for code in cells:
        needs = {
            line.split()[1].split(".")[0]
            for line in code.splitlines()
            if line.startswith(("import ", "from "))
        }
        if not needs <= set(sys.modules):
            continue
        with redirect_stdout(sink), redirect_stderr(sink):
            try:
                exec(compile(code, cell.CELL, "exec"), {"__name__": "__warmup__"})
            except Exception:
                traceback.format_exc()  # the error path must be warm too


# Outcomes the runner reports after user code (cell.py); anything else on the result pipe is ignored.
_OUTCOMES = frozenset({"ok", "syntax_error", "exit", "memory_error", "error"})
# The runner's own texts are far shorter (cell._describe); a report user code wrote can be any size.
REPORT_TEXT_CHARS = 1000


def _last_report(raw: bytes, outcomes: frozenset[str]) -> dict:
    """The last line of `raw` that is a JSON object with a known outcome (never raises)."""
    for line in reversed(raw.split(b"\n")):
        try:
            info = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(info, dict) and info.get("outcome") in outcomes:
            return {
                k: v if isinstance(v, bool | int) else str(v)[:REPORT_TEXT_CHARS] for k, v in info.items()
            }
    return {}


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


@dataclass
class Watch:
    """What the supervisor measured about one call, besides its output."""

    status: int  # wait status of the call's pid 1
    wall_ms: float
    oom: bool
    slot_cpu_ms: float | None  # CPU of every process of the call (cgroup accounting), if available
    run_wait_ms: float | None  # time the call's threads were runnable but not running, at a timeout


def _classify(got: capture.Collected, watch: Watch, limits: Limits) -> ExecResult:
    """How the call ended, from what only the sandbox knows; never raises, never trusts user code.

    A sandbox error is only possible before STARTED: after it, whatever the process wrote to the
    result pipe or exited with is the program's own doing.
    """
    r = ExecResult(
        status=Status.OK,
        stdout=got.stdout.text(),
        stderr=got.stderr.text(),
        wall_ms=round(watch.wall_ms, 2),
        stdout_truncated_bytes=got.stdout.dropped,
        stderr_truncated_bytes=got.stderr.dropped,
    )
    r.extra.update(
        output_bytes=got.stdout.total + got.stderr.total,
        stdout_bytes=got.stdout.total,
        stderr_bytes=got.stderr.total,
        keep_bytes=limits.keep_bytes,
    )
    started = got.result.startswith(forkserver.STARTED)
    status = watch.status
    memory = f"memory limit is {human_bytes(limits.memory_mb * MiB)}"
    if not started:
        info = _last_report(got.result, frozenset({"confine_failed"}))
        r.status = Status.SANDBOX_ERROR
        if watch.oom:
            r.status, r.message = Status.MEMORY_LIMIT, f"MemoryError: stdin does not fit: {memory}"
        elif got.killed == "timeout":
            r.message = "sandbox setup did not finish before the deadline"
        else:
            r.message = f"sandbox setup failed: {info.get('error') or f'wait status {status}'}"
        return r
    info = _last_report(got.result[len(forkserver.STARTED) :], _OUTCOMES)
    if "addresses" in info:  # the object addresses the program printed (addresses.py)
        r.extra["addresses"] = str(info["addresses"]).split()
    if got.killed == "timeout":
        r.status, r.message = Status.TIMEOUT, f"Timed out after {limits.timeout_s:.1f} s"
        if _starved(watch):
            r.status = Status.STARVED
            r.message = (
                f"starved: the call got {watch.slot_cpu_ms:.0f} ms of CPU in {watch.wall_ms:.0f} ms "
                f"(waited {watch.run_wait_ms:.0f} ms to run); the machine is overloaded"
            )
    elif got.killed == "output":
        r.status = Status.OUTPUT_LIMIT
        r.message = f"output limit exceeded: killed after {human_bytes(r.extra['output_bytes'])} (cap {human_bytes(limits.output_bytes)})"
    elif os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        r.signal = sig
        if sig == signal.SIGKILL and watch.oom:
            r.status, r.message = Status.MEMORY_LIMIT, f"MemoryError: {memory}"
        elif sig == signal.SIGXCPU or (
            sig == signal.SIGKILL and not info and watch.wall_ms > limits.timeout_s * 1000
        ):
            r.status, r.message = Status.TIMEOUT, f"Timed out after {limits.timeout_s:.1f} s (CPU time limit)"
        else:
            r.status, r.message = Status.KILLED_BY_SIGNAL, f"killed by {_signal_name(sig)}"
    else:
        r.exit_code = os.WEXITSTATUS(status)
        outcome = info.get("outcome")
        if outcome == "memory_error":
            r.status, r.message = Status.MEMORY_LIMIT, f"MemoryError: {memory}"
        elif outcome == "syntax_error":
            r.status, r.message = Status.SYNTAX_ERROR, info.get("error", "SyntaxError")
        elif outcome == "error":
            r.status, r.message = Status.RUNTIME_ERROR, info.get("error", "error")
            r.extra["error_type"] = info.get("type")
            if info.get("network") is True:
                r.extra["network_blocked"] = True
        elif r.exit_code != 0:
            r.status, r.message = Status.RUNTIME_ERROR, f"exited with code {r.exit_code}"
    return r


def _starved(watch: Watch) -> bool:
    """Little CPU for the whole call while its threads waited to run: other processes had the CPUs.

    Needs the slot's CPU accounting: a call whose own processes compete with each other (e.g. a
    fork bomb throttled by the slot's quota) has used its CPU and is not starved.
    """
    if watch.slot_cpu_ms is None or watch.run_wait_ms is None:
        return False
    return (
        watch.slot_cpu_ms < STARVED_CPU_SHARE * watch.wall_ms
        and watch.run_wait_ms > STARVED_WAIT_SHARE * watch.wall_ms
    )


def _run_wait_ms(pid: int) -> float | None:
    """Sum over the process's threads of the time spent runnable but not running (schedstat)."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e6


def serve_call(
    plan: isolation.Plan, child: forkserver.Prepared, req: dict, server: socket.socket
) -> ExecResult:
    """Hand the call to the prepared child, watch it, have it reaped, and classify how it ended."""
    limits = forkserver.call_limits(req)
    plan.cgroup.set_limits(limits.memory_mb * MiB + ZYGOTE_HEADROOM, limits.max_procs + 1)
    oom_before, cpu_before = plan.cgroup.oom_kills(), plan.cgroup.cpu_ns()
    run_wait: list[float | None] = [None]
    # Only with the slot's CPU accounting (root): there the fork server's pids are the host's too.
    watch_wait = plan.cgroup.active
    start = time.monotonic()
    # The request as a small JSON header, then stdin as raw bytes the child streams into its stdin
    # file: a large stdin is never parsed (nor held twice) inside the call's memory limit.
    stdin = framing.text_bytes(req.get("stdin", ""))
    header = {k: v for k, v in req.items() if k != "stdin"} | {"stdin_bytes": len(stdin)}
    request, child.request = child.request, -1  # collect() writes it and closes it
    try:
        got = capture.collect(
            child.pidfd,
            child.stdout,
            child.stderr,
            child.result,
            start + limits.timeout_s,
            limits.keep_bytes,
            limits.output_bytes,
            before_kill=lambda: run_wait.__setitem__(0, _run_wait_ms(child.pid) if watch_wait else None),
            send=(request, framing.encode(header) + stdin),
        )
    finally:
        child.close()
        server.send(forkserver.NEXT)  # reap it (and prepare the next child while we classify)
    status, cpu_s, faults = forkserver.reaped(server)
    wall_ms = (time.monotonic() - start) * 1000
    cpu_after = plan.cgroup.cpu_ns()
    slot_cpu = (cpu_after - cpu_before) / 1e6 if cpu_before is not None and cpu_after is not None else None
    watch = Watch(status, wall_ms, plan.cgroup.oom_kills() > oom_before, slot_cpu, run_wait[0])
    result = _classify(got, watch, limits)
    result.extra.update(cpu_ms=round(cpu_s * 1000, 2), page_faults=faults)
    if slot_cpu is not None:
        result.extra["slot_cpu_ms"] = round(slot_cpu, 2)
    return result


def _start_fork_server(
    plan: isolation.Plan, program: bytes | None, workdir_mb: int, keep: tuple[int, ...]
) -> socket.socket:
    """Fork the fork server now, while this process has seen no call; returns our end of its socket."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if plan.userns and plan.pid_namespace:
        # The fork server becomes pid 1 of a pid namespace our user namespace owns: it may then
        # point its children's pid namespace back at its own (the host's needs root), so each
        # call is again pid 1 of a namespace of its own.
        linux.unshare(linux.CLONE_NEWPID)
    if os.fork() == 0:
        try:
            ours.close()
            for fd in keep:  # the pool's control pipes: only the supervisor may hold them
                os.close(fd)
            forkserver.serve(theirs, plan, program, workdir_mb)
        finally:
            os._exit(1)
    theirs.close()
    return ours


def main() -> None:
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # stray prints of imported libraries go to the log, not into the protocol
    linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the pool (and take the calls along)
    config = framing.read_frame(ctl_in)
    plan = isolation.Plan.from_dict(config["plan"])
    notes = isolation.isolate_zygote(plan)
    if problem := isolation.protect_from_oom_killer():
        notes.append(problem)
    program = None
    if plan.seccomp:
        from tirl.sandbox import seccomp_filter

        program = seccomp_filter.compile_denylist()
    _warm_up(config.get("preload", list(PRELOAD)), config.get("warmup", list(WARMUP)))
    gc.freeze()  # children's collections never touch (and copy) the zygote's pages
    linux.collapse_to_huge_pages()  # fewer page-table entries: each fork copies (and each exit frees) less
    workdir_mb = config.get("workdir_mb", 64)
    handoff = socket.socket(fileno=config["handoff_fd"]) if "handoff_fd" in config else None
    keep = (ctl_in, ctl_out) if handoff is None else (ctl_in, ctl_out, handoff.fileno())
    server = _start_fork_server(plan, program, workdir_mb, keep)
    del program
    rss0 = _rss_bytes()
    framing.write_frame(ctl_out, {"ready": True, "pid": os.getpid(), "notes": notes, "rss": rss0})
    max_calls, max_growth = config.get("max_calls", 5000), config.get("max_growth_mb", 200) * MiB
    server.send(forkserver.FORK)
    child = forkserver.receive(server)
    for calls in itertools.count(1):
        try:
            req = framing.read_frame(ctl_in)
        except EOFError:
            break
        recycle = calls >= max_calls
        if req.get("session"):  # a session's process, handed to the pool (which owns it from then on)
            try:
                uid = req.get("uid")
                server.send(forkserver.SESSION + (b"%d" % uid if uid is not None else b""))
                session = forkserver.receive(server)
                socket.send_fds(handoff, [b"p%d" % session.pid], list(session.fds()))
                session.close()
                framing.write_frame(ctl_out, {"session": True, "recycle": False})
                continue
            except Exception as exc:  # a refused fork leaves the fork server (and its sessions) serving
                gone = isinstance(exc, forkserver.ForkServerGone | OSError)
                framing.write_frame(ctl_out, {"session": False, "error": repr(exc), "recycle": gone})
                if gone:
                    break
                continue
        try:
            result = serve_call(plan, child, req, server)
            child = forkserver.receive(server)
        except Exception as exc:  # the slot is in an unknown state: say what broke, then be replaced
            result = ExecResult(Status.SANDBOX_ERROR, message=f"sandbox error: {exc!r}")
            recycle = True
        recycle = recycle or _rss_bytes() - rss0 > max_growth
        framing.write_frame(ctl_out, {"result": result.to_dict(), "recycle": recycle})
        if recycle:
            break
    server.close()  # the fork server exits; its prepared child sees EOF (or dies with it)


if __name__ == "__main__":
    main()
