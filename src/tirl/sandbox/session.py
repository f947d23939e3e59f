"""A persistent Python session: one live, confined interpreter that keeps its state across calls.

The paper's release replays every earlier cell of a trajectory on each call (cost quadratic in the
number of calls); a session instead keeps one interpreter alive, so variables, imports and
functions stay defined. Its process is prepared exactly like a stateless call's (fork server,
namespaces, allowlisted root, uid, seccomp, rlimits) and then handed to the pool, which owns it:
it gets its own cgroup (memory, processes, one CPU; frozen between cells, so nothing of it computes
outside a cell), the pool writes each cell to it and reads its output until the runner's
end-of-cell marker (in-band: user code can forge it, but then only ends its own cell early and
stays frozen). A cell that times out or exceeds the output cap kills the session (its state
cannot be trusted half-way through a cell); one killed for memory is lost too. Every later call
then says clearly that the session is gone.

Every byte moved to or from the session happens in the event loop, without blocking and under the
cell's deadline: a session that stops reading its requests (or floods its pipes) costs its own
cell, never a thread, a slot or the pool. Closing kills first and never waits for a running cell.
See docs/sandbox-sessions.md for the guarantees.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import time
from dataclasses import dataclass, field
from typing import Any

from tirl.sandbox import cgroups, forkserver, framing
from tirl.sandbox.capture import CHUNK, StreamCapture
from tirl.sandbox.limits import Limits, MiB
from tirl.sandbox.result import ExecResult, Status, human_bytes

EXIT_WAIT_S = 30.0  # a SIGKILLed session leaves within this (a hang guard: it takes milliseconds)


@dataclass
class _Call:
    stdout: StreamCapture
    stderr: StreamCapture
    result: StreamCapture
    done: asyncio.Future
    killed: str | None = None
    sent: bool = False  # the whole request is in the pipe
    marker: bool = False  # the end-of-cell marker was read


@dataclass
class Session:
    """Handles on one live session process (created by `Sandbox.open_session`)."""

    limits: Limits
    child: forkserver.Prepared
    cgroup: cgroups.SlotCgroup
    id: str = field(default_factory=lambda: secrets.token_urlsafe(12))
    last_used: float = field(default_factory=time.monotonic)
    lost: str | None = None  # why the session is gone, once it is
    calls: int = 0
    owner: Any = None  # the Sandbox pool that opened it (its run/close go through the pool)
    uid_index: int = 0  # which of the pool's session uids it runs as
    released: bool = False  # its uid and memory were given back to the pool
    # What it holds of the pool's memory budget: its limit from its open and in a cell, its use between.
    held_mb: int = field(init=False, default=0)
    exited: bool = False  # its process is known to be gone
    closing: asyncio.Future | None = None  # the pool's one close of it, once started
    # One cell at a time: held by the pool from before a cell waits for a slot until it ends.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Set while no exchange touches the pipes: close() waits for it (bounded), never for the lock.
    _quiet: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._quiet.set()
        self.held_mb = self.limits.memory_mb

    async def run(self, code: str, stdin: str = "", timeout: float | None = None) -> ExecResult:
        """Run one cell in this session (same contract as Sandbox.run)."""
        return await self.owner.run_in_session(self, code, stdin, timeout)

    async def aclose(self) -> None:
        await self.owner.close_session(self)

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def alive(self) -> bool:
        return self.lost is None

    async def start(self, process_limits: Limits) -> ExecResult:
        """Send the session's set-up request and wait until its interpreter is ready.

        `process_limits` are the rlimits of the whole session (its CPU-time budget is for all its calls).
        """
        for fd in (self.child.request, self.child.stdout, self.child.stderr, self.child.result):
            os.set_blocking(fd, False)
        req = {"session": True, "code": "", "stdin": "", "limits": process_limits.model_dump()}
        result = await self._exchange(req, self.limits.timeout_s + 10, first=True)
        self._pause()
        self.last_used = time.monotonic()  # idle from now: a slow start is not idle time the reaper counts
        return result

    async def run_cell(self, code: str, stdin: str, timeout: float) -> ExecResult:
        """Run one cell in the session's namespace (the caller holds `lock` and a slot of the pool)."""
        if self.lost is not None or self.child.pidfd < 0:
            return gone(self.lost or "it was closed")
        self.last_used = time.monotonic()
        self.cgroup.freeze(False)
        result = await self._exchange({"code": code, "stdin": stdin}, timeout or self.limits.timeout_s)
        self._pause()
        self.calls += 1
        self.last_used = time.monotonic()
        return result

    async def _exchange(self, req: dict, timeout: float, first: bool = False) -> ExecResult:
        """Write the request and read the cell's output, all under `timeout` (the cell's deadline)."""
        loop = asyncio.get_running_loop()
        keep = self.limits.keep_bytes
        call = _Call(StreamCapture(keep), StreamCapture(keep), StreamCapture(CHUNK), loop.create_future())
        oom_before = self.cgroup.oom_kills()
        start = time.monotonic()
        self._quiet.clear()
        try:
            self._watch(loop, call, framing.encode(req))
            try:
                await asyncio.wait_for(asyncio.shield(call.done), timeout)
            except TimeoutError:
                call.killed = "timeout"
            except asyncio.CancelledError:  # the caller gave up mid-cell: its state is unknown
                self.lost = self.lost or "its cell was interrupted"
                self._kill()
                raise
            finally:
                self._unwatch(loop)
            wall_ms = (time.monotonic() - start) * 1000
            ended = call.done.done() and call.done.result() == "exited"
            if call.killed or ended or self.lost is not None:
                self._kill()
                await self._wait_exit()
            _drain(self.child.stdout, call.stdout)
            _drain(self.child.stderr, call.stderr)
            oom = self.cgroup.oom_kills() > oom_before
            return self._classify(call, wall_ms, oom, ended, first, timeout)
        finally:
            self._quiet.set()

    def _classify(
        self, call: _Call, wall_ms: float, oom: bool, ended: bool, first: bool, timeout: float
    ) -> ExecResult:
        from tirl.sandbox.zygote import _OUTCOMES, _last_report  # the one reading of runner reports

        r = ExecResult(
            Status.OK,
            stdout=call.stdout.text(),
            stderr=call.stderr.text(),
            wall_ms=round(wall_ms, 2),
            stdout_truncated_bytes=call.stdout.dropped,
            stderr_truncated_bytes=call.stderr.dropped,
        )
        r.extra.update(
            stdout_bytes=call.stdout.total,
            stderr_bytes=call.stderr.total,
            keep_bytes=self.limits.keep_bytes,
            session=self.id,
        )
        raw = bytes(call.result.head + call.result.tail)
        if first:
            raw = raw.removeprefix(forkserver.STARTED) if raw.startswith(forkserver.STARTED) else b""
            if not raw.endswith(forkserver.SESSION_DONE):
                self.lost = "it failed to start"
                return ExecResult(Status.SANDBOX_ERROR, message="sandbox error: the session failed to start")
        info = _last_report(raw, _OUTCOMES)
        if "addresses" in info:  # the object addresses the cell printed (addresses.py)
            r.extra["addresses"] = str(info["addresses"]).split()
        memory = f"memory limit is {human_bytes(self.limits.memory_mb * MiB)}"
        if call.killed == "timeout":
            self.lost = f"its cell timed out after {timeout:.1f} s"
            r.status, r.message = Status.TIMEOUT, f"Timed out after {timeout:.1f} s; the session was lost"
        elif call.killed == "output":
            self.lost = "its cell exceeded the output limit"
            r.status = Status.OUTPUT_LIMIT
            r.message = (
                f"output limit exceeded (cap {human_bytes(self.limits.output_bytes)}); the session was lost"
            )
        elif ended:
            self.lost = "it was killed for exceeding its memory limit" if oom else "its process exited"
            r.status = Status.MEMORY_LIMIT if oom else Status.RUNTIME_ERROR
            r.message = (
                f"MemoryError: {memory}; the session was lost" if oom else "the session's process exited"
            )
        elif info.get("outcome") == "memory_error":
            r.status, r.message = Status.MEMORY_LIMIT, f"MemoryError: {memory}"
        elif info.get("outcome") == "syntax_error":
            r.status, r.message = Status.SYNTAX_ERROR, info.get("error", "SyntaxError")
        elif info.get("outcome") == "error":
            r.status, r.message = Status.RUNTIME_ERROR, info.get("error", "error")
            if info.get("network") is True:
                r.extra["network_blocked"] = True
        elif info.get("outcome") == "exit" and info.get("exit_code"):
            r.exit_code = info["exit_code"] if isinstance(info["exit_code"], int) else 1
            r.status, r.message = Status.RUNTIME_ERROR, f"exited with code {r.exit_code}"
        if self.lost is not None and not first:
            r.message += f" ({self.lost}: its variables are gone; open a new session)"
            r.extra["session_lost"] = True
        return r

    # ---- I/O on the session's pipes (non-blocking, in the event loop) ----

    def _watch(self, loop: asyncio.AbstractEventLoop, call: _Call, request: bytes) -> None:
        pending = memoryview(request)

        def writer() -> None:
            nonlocal pending
            try:
                pending = pending[os.write(self.child.request, pending[: 1 << 20]) :]
            except BlockingIOError:
                return
            except OSError:  # the process is gone: its exit (pidfd) settles the call
                pending = pending[:0]
            if not pending:
                if not call.sent:
                    loop.remove_writer(self.child.request)
                call.sent = True
                if call.marker:
                    _settle(call.done, "done")

        def reader(fd: int, sink: StreamCapture) -> None:
            try:
                data = os.read(fd, CHUNK)
            except BlockingIOError:
                return
            if not data:
                loop.remove_reader(fd)
                return
            sink.feed(data)
            if sink is call.result and forkserver.SESSION_DONE in bytes(
                call.result.tail[-64:] or call.result.head[-64:]
            ):
                call.marker = True
                if call.sent:  # a marker forged before its request arrived ends nothing
                    _settle(call.done, "done")
            # the result pipe counts too: whatever the cell writes is read by this process
            written = call.stdout.total + call.stderr.total + call.result.total
            if written > self.limits.output_bytes and not call.done.done():
                call.killed = "output"
                _settle(call.done, "output")

        for fd, sink in (
            (self.child.stdout, call.stdout),
            (self.child.stderr, call.stderr),
            (self.child.result, call.result),
        ):
            loop.add_reader(fd, reader, fd, sink)
        loop.add_reader(self.child.pidfd, _settle, call.done, "exited")
        writer()  # most requests fit in the pipe at once: no wait for the loop
        if not call.sent:
            loop.add_writer(self.child.request, writer)

    def _unwatch(self, loop: asyncio.AbstractEventLoop) -> None:
        for fd in (self.child.stdout, self.child.stderr, self.child.result, self.child.pidfd):
            if fd >= 0:
                loop.remove_reader(fd)
        if self.child.request >= 0:
            loop.remove_writer(self.child.request)

    def memory_in_use_mb(self) -> int:
        """What the session uses now, in MiB rounded up (at least 1, at most its limit): its cgroup's
        memory (every process of it, page cache and tmpfs files included). Without a memory cgroup and
        a freezer (not root), its limit: nothing would stop it growing between cells unseen."""
        used = self.cgroup.memory_bytes() if self.cgroup.freezer_dir else None
        if used is None:
            return self.limits.memory_mb
        return max(1, min(self.limits.memory_mb, -(-used // MiB)))

    def _pause(self) -> None:
        """Between cells nothing of the session runs: not a thread a cell left spinning, not a cell
        that wrote the end-of-cell marker itself to return early (that marker is in-band: user code
        can forge it). Whatever it was doing resumes in, and counts against, its next cell."""
        if self.lost is None:
            self.cgroup.freeze(True)

    def _kill(self) -> None:
        self.cgroup.freeze(False)  # a frozen process cannot act on SIGKILL until thawed (cgroup v1)
        with contextlib.suppress(OSError):
            signal.pidfd_send_signal(self.child.pidfd, signal.SIGKILL)  # pid 1: its whole namespace goes

    async def _wait_exit(self) -> None:
        if self.exited or self.child.pidfd < 0:
            return
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(self.child.pidfd, _settle, exited, "exited")
        try:
            await asyncio.wait_for(exited, EXIT_WAIT_S)
            self.exited = True
        except TimeoutError:
            pass
        finally:
            loop.remove_reader(self.child.pidfd)

    async def close(self, reason: str = "it was closed") -> None:
        """End the session and free everything it held: SIGKILL first, so a running cell (or one
        stuck writing its request) ends at once; nothing here waits for the session's lock."""
        if self.lost is None:
            self.lost = reason
        if self.child.pidfd < 0:
            return
        self._kill()
        with contextlib.suppress(TimeoutError):  # a running exchange sees the exit and lets go
            await asyncio.wait_for(self._quiet.wait(), EXIT_WAIT_S)
        await self._wait_exit()
        self.child.close()
        self.cgroup.close()
        # the fork server reaps the process; its cgroup can go once it is empty
        for _ in range(100):
            cgroups.remove_slot_cgroups([self.cgroup])
            if not any(os.path.isdir(d) for d in self.cgroup.dirs()):
                break
            await asyncio.sleep(0.01)


def _settle(future: asyncio.Future, value: str) -> None:
    if not future.done():
        future.set_result(value)


def _drain(fd: int, sink: StreamCapture) -> None:
    """What the cell wrote before its end marker and is still in the pipe."""
    while True:
        try:
            data = os.read(fd, CHUNK)
        except (BlockingIOError, OSError):
            return
        if not data:
            return
        sink.feed(data)


def gone(why: str) -> ExecResult:
    return ExecResult(
        Status.RUNTIME_ERROR,
        message=f"this Python session is gone ({why}): its variables are lost; open a new session",
        extra={"session_lost": True},
    )
