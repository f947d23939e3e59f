"""Reading a running call's output: both pipes drained while it runs, head and tail kept.

Nothing waits for exit before reading (the SandboxFusion failure mode), memory stays bounded
by keep_bytes whatever the program prints, and the call is killed at the hard output cap or
at its deadline, whichever comes first.
"""

from __future__ import annotations

import os
import selectors
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tirl.sandbox.result import human_bytes

CHUNK = 1 << 16


@dataclass
class StreamCapture:
    """First and last `keep` bytes of a stream, and how many bytes it had in total."""

    keep: int
    head: bytearray = field(default_factory=bytearray)
    tail: bytearray = field(default_factory=bytearray)
    total: int = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.keep - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > self.keep:
                del self.tail[: len(self.tail) - self.keep]

    @property
    def dropped(self) -> int:
        return self.total - len(self.head) - len(self.tail)

    def text(self) -> str:
        """UTF-8 text (invalid bytes as backslash escapes); a marker line where bytes were dropped."""
        head = self.head.decode("utf-8", "backslashreplace")
        tail = self.tail.decode("utf-8", "backslashreplace")
        if not self.dropped:
            return head + tail
        return f"{head}\n[... {human_bytes(self.dropped)} truncated ...]\n{tail}"


@dataclass
class Collected:
    stdout: StreamCapture
    stderr: StreamCapture
    result: bytes  # the result pipe: the runner's reports, or what user code wrote there
    killed: str | None  # "timeout" | "output" | None


def collect(
    pidfd: int,
    out_fd: int,
    err_fd: int,
    result_fd: int,
    deadline: float,
    keep: int,
    cap: int,
    before_kill: Callable[[], None] | None = None,
    send: tuple[int, bytes] | None = None,
) -> Collected:
    """Drain the call's pipes until it exits and they close, or kill it at the deadline/cap.

    `pidfd` may belong to a process we did not fork (the fork server is its parent); `before_kill`
    runs just before a deadline kill, while the call's threads can still be inspected. `send`:
    bytes written to a pipe of the call as it reads them (its request and stdin), under the same
    deadline, then the pipe is closed (a call too slow to take its input cannot hang us).
    """
    got = Collected(StreamCapture(keep), StreamCapture(keep), b"", None)
    # Drained like the others (a writer blocked on a full pipe would hang the call); the start
    # marker is at the head, the runner's final report at the tail.
    result = StreamCapture(CHUNK)
    sinks = {out_fd: got.stdout.feed, err_fd: got.stderr.feed, result_fd: result.feed}
    sel = selectors.DefaultSelector()
    for fd in (*sinks, pidfd):
        sel.register(fd, selectors.EVENT_READ)
    exited = False
    out_fd_w, pending = send if send is not None else (-1, b"")
    view = memoryview(pending)
    if out_fd_w >= 0:
        os.set_blocking(out_fd_w, False)
        sel.register(out_fd_w, selectors.EVENT_WRITE)
    try:
        while sinks or not exited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                got.killed = "timeout"
                break
            for key, _ in sel.select(remaining):
                fd = key.fd
                if fd == out_fd_w:
                    try:
                        view = view[os.write(fd, view[: 1 << 20]) :]
                    except BrokenPipeError:  # it died in set-up; it says why on the result pipe
                        view = view[:0]
                    if not view:
                        sel.unregister(fd)
                        os.close(fd)
                        out_fd_w = -1
                    continue
                if fd == pidfd:
                    exited = True
                    sel.unregister(pidfd)
                    continue
                data = os.read(fd, CHUNK)
                if data:
                    sinks[fd](data)
                else:
                    sel.unregister(fd)
                    del sinks[fd]
            if got.stdout.total + got.stderr.total + result.total > cap:  # the result pipe: we read it too
                got.killed = "output"
                break
    finally:
        if got.killed:
            if got.killed == "timeout" and before_kill is not None:
                before_kill()
            # pid 1 of its namespace: the kernel kills every descendant
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        if out_fd_w >= 0:
            os.close(out_fd_w)
        sel.close()
    got.result = (
        bytes(result.head + b"\n" + result.tail) if result.dropped else bytes(result.head + result.tail)
    )
    return got
