"""The fork server of a slot: forks and confines each call's process, and never sees a call.

It is forked from the warm zygote right after warm-up, before any call exists, and from then on
receives only one-byte commands from the slot's supervisor over a socket: FORK (prepare a child)
or NEXT (reap the child that ran, then prepare the next). It answers with the new child's pipes
(passed as file descriptors) and, for NEXT, the exit status of the reaped child (only a parent
can reap). A call's code, stdin and output travel between the supervisor and the child directly:
no call's data ever enters this process, so the memory every child starts from (a copy of this
process's) holds nothing of any earlier call.

The child confines itself at once (isolation.confine_call), then waits for its call on a pipe,
applies the call's limits, writes STARTED on the result pipe and only then runs user code. So a
failure reported before STARTED is the sandbox's, and nothing user code does can pose as one.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import select
import signal
import socket
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, cast

from tirl import linux
from tirl.sandbox import cell, framing, isolation
from tirl.sandbox.isolation import MiB

if TYPE_CHECKING:
    from tirl.sandbox.limits import Limits

# SESSION + uid: fork a session's process (its own uid and network namespace: nothing it leaves
# running can meet the slot's calls or other sessions); it is reaped whenever it ends.
FORK, NEXT, SESSION = b"f", b"n", b"S"
REQUEST_FD = cell.RESULT_FD + 1  # the prepared child reads its call from here
CONFINE_FAILED = 121  # exit code of a child whose set-up failed (only meaningful before STARTED)
STARTED = b"\x00started\n"  # first bytes on the result pipe once set-up is done and user code starts
SESSION_DONE = b"\x00done\n"  # a session's runner wrote this cell's report: its output is complete


_streams: cell.Streams  # the calls' stdin/stdout/stderr, made once per fork server (serve)


@dataclass
class Prepared:
    """The supervisor's handles on a child forked and confined ahead of its call."""

    pid: int
    pidfd: int
    request: int  # write end: the call's frame
    stdout: int
    stderr: int
    result: int

    def fds(self) -> tuple[int, int, int, int, int]:
        return self.pidfd, self.request, self.stdout, self.stderr, self.result

    def close(self) -> None:
        for fd in self.fds():
            if fd >= 0:
                os.close(fd)
        self.pidfd = self.request = self.stdout = self.stderr = self.result = -1


class ForkServerGone(RuntimeError):
    """The fork server exited (a refused fork leaves it serving: see FAILED)."""


FAILED = b"e"  # a fork the fork server could not make (e.g. EAGAIN): it says why and serves on


def receive(sock: socket.socket) -> Prepared:
    """(supervisor) The next prepared child, as sent by the fork server."""
    msg, fds, _, _ = socket.recv_fds(sock, 256, 5)
    if not msg.startswith(b"p") or len(fds) != 5:
        for fd in fds:
            os.close(fd)
        if not msg.startswith(FAILED):
            raise ForkServerGone(f"the fork server failed (sent {msg[:40]!r})")
        raise RuntimeError(f"the fork server could not fork: {msg[1:200].decode(errors='replace')}")
    return Prepared(int(msg[1:]), *fds)


def reaped(sock: socket.socket) -> tuple[int, float, int]:
    """(supervisor) The wait status, CPU seconds and minor faults of the child that ran."""
    msg = sock.recv(256)
    if not msg.startswith(b"s"):
        raise RuntimeError(f"the fork server failed (sent {msg[:40]!r})")
    status, cpu_s, faults = json.loads(msg[1:])
    return int(status), float(cpu_s), int(faults)


def serve(sock: socket.socket, plan: isolation.Plan, program: bytes | None, workdir_mb: int) -> None:
    """(fork server) Prepare children on request until the supervisor goes away; never returns."""
    linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the supervisor (children follow)
    # Children are born in the slot's cgroups instead of migrating into them per call (a cgroup v1
    # migration costs milliseconds). Joining after warm-up leaves the warm pages charged to the
    # service, so a slot's usage is its call's memory plus the fork server's small growth.
    plan.cgroup.join()
    if len(os.listdir("/proc/self/task")) != 1:  # linux.fork_bare is only sound in a single thread
        raise RuntimeError("the fork server must be single-threaded")
    isolation.clean_environment()  # once here instead of in every call
    seccomp = linux.seccomp_fprog(program) if program is not None else None
    global _streams
    _streams = cell.make_streams()  # never written here: each child gets them as new
    own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    for fd in range(REQUEST_FD + 1):  # taken, so every pipe of a child gets a descriptor above them
        try:
            os.fstat(fd)
        except OSError:
            os.dup2(devnull, fd, inheritable=False)
    os.dup2(devnull, 0, inheritable=True)  # the children's stdin until their call's arrives
    running: collections.deque[int] = collections.deque()
    sessions: dict[int, int] = {}  # pidfd -> pid of children living on as sessions (reaped when they end)
    while True:
        ready, _, _ = select.select([sock, *sessions], [], [])
        for pidfd in set(ready) & set(sessions):
            os.waitpid(sessions.pop(pidfd), 0)
            os.close(pidfd)
        if sock not in ready:
            continue
        try:
            command = sock.recv(64)
        except OSError:
            break
        if not command:
            break
        if command.startswith(SESSION):
            uid = int(command[1:]) if command[1:] else plan.uid
            session_plan = dataclasses.replace(plan, uid=uid, own_network=plan.namespaces)
            try:
                pid = _prepare(sock, session_plan, seccomp, own_pidns, workdir_mb)
            except OSError as exc:  # refused (processes, memory): that session fails, we serve on
                sock.send(FAILED + repr(exc).encode()[:200])
                continue
            sessions[os.pidfd_open(pid)] = pid
            continue
        if command == NEXT and running:
            _reap(sock, running.popleft())
        running.append(_prepare(sock, plan, seccomp, own_pidns, workdir_mb))
    os._exit(0)  # prepared children see EOF on their request pipe and exit; PDEATHSIG does the rest


def _reap(sock: socket.socket, pid: int) -> None:
    _, status, usage = os.wait4(pid, 0)  # pid 1 exits last: the call's whole namespace is gone
    sock.send(b"s" + json.dumps([status, usage.ru_utime + usage.ru_stime, usage.ru_minflt]).encode())


def _prepare(
    sock: socket.socket,
    plan: isolation.Plan,
    seccomp: linux.SockFprog | None,
    own_pidns: int,
    workdir_mb: int,
) -> int:
    """Fork and confine the next call's process now, so the call itself only runs the code."""
    request, out, err, res = (os.pipe() for _ in range(4))
    address_space = _vm_bytes()  # the child's, as it starts: measured here, not in its own memory
    try:
        if plan.pid_namespace:
            # The next child becomes pid 1 of a fresh pid namespace. The kernel allows this only while
            # our children's pid namespace is still our own, so point it back there first.
            linux.setns(own_pidns, linux.CLONE_NEWPID)
            linux.unshare(linux.CLONE_NEWPID)
        pid = linux.fork_bare()  # single-threaded: no after-fork hooks needed (the child reseeds)
    except BaseException:
        for fd in (*request, *out, *err, *res):
            os.close(fd)
        raise
    if pid == 0:
        try:
            _child(plan, seccomp, workdir_mb, address_space, (request[0], out[1], err[1], res[1]))
        finally:
            os._exit(CONFINE_FAILED)
    ours = (os.pidfd_open(pid), request[1], out[0], err[0], res[0])
    try:
        socket.send_fds(sock, [b"p%d" % pid], list(ours))
    finally:
        for fd in (*ours, request[0], out[1], err[1], res[1]):
            os.close(fd)
    return pid


def _child(
    plan: isolation.Plan,
    seccomp: linux.SockFprog | None,
    workdir_mb: int,
    address_space: int,
    fds: tuple[int, int, int, int],
) -> None:
    """In the forked child: wire fds, confine, wait for the call, apply its limits, run it. Never returns."""
    try:
        # fd 0 stays the fork server's /dev/null until the call's stdin arrives; our pipes are >= 5
        # (serve keeps 0-4 taken), so no dup2 below overwrites another of them.
        for fd, target in zip(fds, (REQUEST_FD, 1, 2, cell.RESULT_FD), strict=True):
            os.dup2(fd, target)
        os.closerange(REQUEST_FD + 1, 1 << 16)  # nothing of the fork server leaks into user code
        isolation.confine_call(plan, seccomp, workdir_mb)
        _reseed()  # each child reseeds after its own fork: no two calls share random state
        cell.open_streams(_streams)
    except BaseException as exc:  # report, never run user code half-confined
        _fail(exc)
    try:
        req = framing.read_frame(REQUEST_FD)
    except EOFError:
        os._exit(0)  # the supervisor is shutting down
    session = bool(req.get("session"))
    try:
        _set_stdin(req)  # before the limits: stdin is not the code's file output
        if not session:
            os.close(REQUEST_FD)
        limits = call_limits(req)
        isolation.apply_limits(limits, address_space + limits.memory_mb * MiB, isolation.nproc_others(plan))
        os.write(cell.RESULT_FD, STARTED)
    except BaseException as exc:
        _fail(exc)
    if session:
        _serve_session(req)
    cell.run_cell(req["code"])


def _set_stdin(req: dict) -> None:
    """The call's stdin as a file on fd 0: raw bytes following the request (stateless calls), or
    the request's own "stdin" text (sessions)."""
    stdin_fd = os.memfd_create("stdin")
    if "stdin_bytes" in req:
        left = req["stdin_bytes"]
        while left:
            chunk = os.read(REQUEST_FD, min(left, 1 << 20))
            if not chunk:
                raise EOFError("the request ended before its stdin")
            os.write(stdin_fd, chunk)
            left -= len(chunk)
    else:
        os.write(stdin_fd, framing.text_bytes(req.get("stdin", "")))
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    os.dup2(stdin_fd, 0)
    os.close(stdin_fd)


def _serve_session(req: dict) -> None:
    """A persistent interpreter: one namespace, one cell per request, SESSION_DONE after each. Never returns."""
    namespace = cell.main_namespace()
    while True:
        _, report = cell.execute(req.get("code", ""), namespace, keep=True)
        cell.report(**report, end=SESSION_DONE)
        try:
            req = framing.read_frame(REQUEST_FD)
            _set_stdin(req)
            sys.stdin = cell.reader(0)
        except EOFError:
            os._exit(0)  # closed
        except BaseException:
            os._exit(CONFINE_FAILED)


def call_limits(req: dict) -> Limits:
    """The call's limits as plain attributes: the pool validated them, and pydantic stays out of
    the zygote's image (every byte of it is copied by each fork)."""
    return cast("Limits", SimpleNamespace(**req["limits"]))


def _fail(exc: BaseException) -> None:
    try:
        os.write(cell.RESULT_FD, json.dumps({"outcome": "confine_failed", "error": repr(exc)}).encode())
    finally:
        os._exit(CONFINE_FAILED)


def _vm_bytes() -> int:
    fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
    try:
        return int(os.read(fd, 256).split()[0]) * os.sysconf("SC_PAGE_SIZE")
    finally:
        os.close(fd)


def _reseed() -> None:
    import random

    random.seed()
    if "numpy.random" in sys.modules:  # loaded in the zygote: its state was copied by the fork
        sys.modules["numpy.random"].seed()
