"""The pool's persistent sessions: opening, running cells, closing and expiring them, beside the pool.

`Sandbox` (pool.py) runs stateless calls on its slots; this manager owns the sessions (session.py:
one session's process and pipes). Both ask one `Admission` (admission.py) before anything waits:
the session cap, the memory budget (sessions share what the budget leaves after the share kept for
stateless calls; a session holds its limit while it opens and while a cell runs, and what it really
uses while idle) and the queue bound over calls and session cells together. A session's process
comes from the pool's session zygote (a zygote that serves no call, so no call, recycle or respawn
ends a session), gets its own uid, network namespace and (as root) its own cgroup; a cell holds one
of the pool's slots only while it runs. docs/sandbox-sessions.md states the guarantees.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from typing import Any, Protocol

from tirl.sandbox import cgroups, forkserver, framing
from tirl.sandbox.admission import Admission, SessionError
from tirl.sandbox.limits import Limits, MiB
from tirl.sandbox.result import ExecResult, Status
from tirl.sandbox.session import Session, gone

GRACE_S = 10.0  # how long the session zygote may take to hand a session process over


class SessionHost(Protocol):
    """What the manager needs of the pool: its queue time-out, slots, and the session zygote."""

    queue_timeout_s: float

    def call_limits(self, timeout: float | None = None, limits: Limits | dict | None = None) -> Limits: ...

    async def acquire_slot(self, timeout: float) -> Any | None: ...

    def release_slot(self, slot: Any) -> None: ...

    async def session_zygote(self) -> Any: ...  # a zygote lane: .proc (its frames) and .handoff


def _no_slot(waited_s: float) -> ExecResult:
    return ExecResult(Status.QUEUE_TIMEOUT, message=f"no free slot within {waited_s:g} s")


def _discard_prepared(task: asyncio.Task) -> None:
    """A session process whose opener gave up: killed (its fork server reaps it), fds closed."""
    if task.cancelled() or task.exception() is not None:
        return
    child = task.result()
    with contextlib.suppress(OSError):
        signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
    child.close()


class SessionManager:
    """The live sessions of one pool, each with a uid index of its own (`uids` of them at most)."""

    def __init__(
        self,
        host: SessionHost,
        admission: Admission,
        *,
        first_uid: int | None,
        uids: int,
        idle_s: float,
        cpu_s: float,
    ) -> None:
        self.host, self.admission = host, admission
        self.first_uid, self.uids = first_uid, uids  # first_uid None: not root, no uid per session
        self.idle_s, self.cpu_s = idle_s, cpu_s
        self.live: dict[str, Session] = {}
        self.uids_in_use: set[int] = set()  # indices within the pool's session uid range
        self._handoff_lock = asyncio.Lock()
        self._reaper: asyncio.Task | None = None

    # ---- opening ----

    async def open(self, limits: Limits) -> Session:
        """A live interpreter with `limits` (already clamped by the pool); SessionError if refused."""
        uid_index = self._admit(limits)
        session = None
        try:
            session = await self._start(limits, uid_index)
        finally:
            if session is None:
                self._release_held(uid_index, limits.memory_mb)
        self.live[session.id] = session
        self._settle(session)
        self._reap_idle_later()
        return session

    def _admit(self, limits: Limits) -> int:
        """Count a new session against the cap and the memory budget before anything waits; its uid index."""
        self.admission.admit_session(limits.memory_mb)
        # held <= max_sessions <= uids and each held session has at most one index: one is free
        uid_index = min(set(range(self.uids)) - self.uids_in_use)
        self.uids_in_use.add(uid_index)
        return uid_index

    def _release_held(self, uid_index: int, memory_mb: int) -> None:
        self.uids_in_use.discard(uid_index)
        self.admission.release_session(memory_mb)

    def _release(self, session: Session) -> None:
        """Give back what a session held, once (its process is gone)."""
        if not session.released:
            session.released = True
            self._release_held(session.uid_index, session.held_mb)

    def _settle(self, session: Session) -> None:
        """An idle session holds what it uses (frozen, it cannot grow until its next cell)."""
        if session.released or session.lost is not None:
            return
        used = session.memory_in_use_mb()
        if used < session.held_mb:
            self.admission.resize_session(session.held_mb, used)
            session.held_mb = used

    async def _start(self, limits: Limits, uid_index: int) -> Session:
        uid = self.first_uid + uid_index if self.first_uid is not None else None
        child = await self._hand_off(uid)
        session = Session(limits, child, cgroups.SlotCgroup(), owner=self, uid_index=uid_index)
        try:
            session.cgroup = self._cgroup(child.pid, limits)
            ready = await session.start(limits.with_overrides(timeout_s=self.cpu_s))
        except BaseException:
            await asyncio.shield(session.close("it failed to start"))
            raise
        if not session.alive:
            await session.close("it failed to start")
            raise SessionError(ready.message)
        return session

    async def _hand_off(self, uid: int | None) -> forkserver.Prepared:
        """A new session process from the session zygote. A caller that gives up mid-way does not
        leave the zygote's protocol half-read: the hand-off finishes and its process is discarded."""
        task = asyncio.ensure_future(self._hand_off_locked(uid))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(_discard_prepared)
            raise

    async def _hand_off_locked(self, uid: int | None) -> forkserver.Prepared:
        async with self._handoff_lock:
            lane = await self.host.session_zygote()
            proc = lane.proc
            try:
                proc.stdin.write(framing.encode({"session": True, "uid": uid}))
                reply = await asyncio.wait_for(framing.read_frame_async(proc.stdout), GRACE_S)
            except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()  # replaced on the next open
                raise SessionError("sandbox error: the session zygote did not answer") from None
            if not reply.get("session"):
                if reply.get("recycle"):
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                raise SessionError(f"sandbox error: no session process ({reply.get('error')})")
            return forkserver.receive(lane.handoff)

    def _cgroup(self, pid: int, limits: Limits) -> cgroups.SlotCgroup:
        """The session's own cgroup (memory, processes, one CPU, frozen between cells): its memory is
        never a slot's, and it computes only while a cell of it holds a slot."""
        if self.first_uid is None:
            return cgroups.SlotCgroup()
        groups, _ = cgroups.create_slot_cgroups(cgroups.service_name(), 1, freezer=True)
        group = groups[0]
        group.open()
        group.set_limits(limits.memory_mb * MiB, limits.max_procs)
        group.join(pid)
        return group

    # ---- cells ----

    def get(self, session_id: str) -> Session | None:
        return self.live.get(session_id)

    async def run_in_session(
        self, session: Session, code: str, stdin: str = "", timeout: float | None = None
    ) -> ExecResult:
        """One cell in `session`. It waits for the session's earlier cells holding nothing, then for
        a slot (sessions share the pool's CPUs); both waits count in the queue and end with it."""
        timeout = self.host.call_limits(timeout).timeout_s
        if session.lost is not None:
            return gone(session.lost)
        if (refused := self.admission.queue_refusal()) is not None:
            return refused
        queue_timeout_s = self.host.queue_timeout_s
        deadline = time.monotonic() + queue_timeout_s
        self.admission.waiting += 1
        try:
            if session.lock.locked():
                await asyncio.wait_for(session.lock.acquire(), queue_timeout_s)
            else:
                await session.lock.acquire()  # free: taken at once (no task for a timeout)
        except TimeoutError:
            return ExecResult(
                Status.QUEUE_TIMEOUT,
                message=f"the session was busy with earlier cells for {queue_timeout_s:g} s",
            )
        finally:
            self.admission.waiting -= 1
        try:
            return await self._run_cell_locked(session, code, stdin, timeout, deadline)
        finally:
            session.lock.release()

    async def _run_cell_locked(
        self, session: Session, code: str, stdin: str, timeout: float, deadline: float
    ) -> ExecResult:
        if session.lost is not None:
            return gone(session.lost)
        slot = await self.host.acquire_slot(deadline - time.monotonic())
        if slot is None:
            return _no_slot(self.host.queue_timeout_s)
        # A cell may use the session's whole limit: held again while it runs, given back after.
        if (why := self.admission.resize_session(session.held_mb, session.limits.memory_mb)) is not None:
            self.host.release_slot(slot)
            return ExecResult(Status.QUEUE_TIMEOUT, message=why)
        session.held_mb = session.limits.memory_mb
        try:
            return await session.run_cell(code, stdin, timeout)
        finally:
            self.host.release_slot(slot)
            if session.lost is not None and session.exited:
                self._release(session)  # its memory and uid are free now; it stays listed to say why
            else:
                self._settle(session)

    # ---- closing ----

    async def close_session(self, session: Session | str) -> bool:
        """Close a session (by object or id); False if it was not live (or another caller closes it)."""
        s = self.live.get(session if isinstance(session, str) else session.id)
        if s is None:
            return False
        return await self._close(s, "it was closed")

    async def close_all(self, reason: str) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        await asyncio.gather(*(self._close(s, reason) for s in list(self.live.values())))

    async def _close(self, session: Session, reason: str) -> bool:
        """Close once: a second closer waits for the first (freeing its uid twice could let two live
        sessions share one) and returns False. Listed until everything it held is released."""
        if session.closing is not None:
            await asyncio.shield(session.closing)
            return False
        session.closing = asyncio.ensure_future(self._finish_close(session, reason))
        await asyncio.shield(session.closing)  # a caller that gives up does not stop the clean-up
        return True

    async def _finish_close(self, session: Session, reason: str) -> None:
        try:
            await session.close(reason)  # kills first: never waits for a running cell
        finally:
            self._release(session)
            self.live.pop(session.id, None)

    def _reap_idle_later(self) -> None:
        if self._reaper is not None and not self._reaper.done():
            return
        self._reaper = asyncio.create_task(self._reap_idle(), name="session-reaper")

    async def _reap_idle(self) -> None:
        while self.live and not self.admission.closed:
            await asyncio.sleep(min(30.0, self.idle_s / 4))
            now = time.monotonic()
            for s in list(self.live.values()):
                if s.lock.locked():
                    continue  # a cell runs or waits: not idle
                if not s.alive or now - s.last_used > self.idle_s:
                    await self._close(s, f"it was idle for more than {self.idle_s:g} s")
