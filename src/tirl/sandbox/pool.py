"""`Sandbox`: an in-process pool of warm zygote slots behind a bounded queue.

Each slot serves one call at a time from a zygote process (tirl.sandbox.zygote): the heavy one
(numpy/sympy/scipy preloaded) or its light stdlib-only twin, picked by the cell's imports
(imports.py); both confine calls identically, the light one forks and exits faster. Callers wait
for a free slot at most `queue_timeout_s` (then `queue_timeout`), and at most `max_queue` callers
wait at once (beyond that: `queue_timeout` at once). A zygote that dies or hangs is replaced and
the call reports `sandbox_error`; neither is ever presented as the program's fault.

Persistent sessions are managed beside the pool (session_manager.py) and forked by a zygote of
their own that the pool keeps and that serves no call, so no call, recycle or respawn ends one.
Calls and sessions ask one admission rule (admission.py): the queue bound, the session cap and one
memory budget, of which a share is kept for stateless calls. docs/sandbox-sessions.md states the
guarantees.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import itertools
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tirl.sandbox import cgroups, framing, imports, isolation, netns, seccomp_filter, zygote
from tirl.sandbox.admission import Admission, default_calls_reserve_mb
from tirl.sandbox.admission import SessionError as SessionError  # raised by open_session
from tirl.sandbox.limits import DEFAULT_LIMITS, SERVER_MAXIMA, Limits, MiB, host_memory_bytes
from tirl.sandbox.result import ExecResult, Status
from tirl.sandbox.session import Session
from tirl.sandbox.session_manager import SessionManager

GRACE_S = 10.0  # beyond the call's own deadline, how long a silent zygote is trusted
START_TIMEOUT_S = 180.0


@dataclass
class _Slot:
    """One call at a time; served by its zygote, or by its light twin when the cell allows."""

    index: int
    plan: isolation.Plan
    config: dict = field(default_factory=dict)  # the zygote's preload, warm-up and recycling
    proc: asyncio.subprocess.Process | None = None
    calls: int = 0
    notes: tuple[str, ...] = ()
    # A stdlib-only zygote with its own uid and cgroup (so per-call limits stay exact), for cells
    # that import nothing heavy: a small image forks and exits several times faster (imports.py).
    light: _Slot | None = None
    handoff: socket.socket | None = None  # our end of the socket the zygote hands sessions over

    def lanes(self) -> list[_Slot]:
        return [self] if self.light is None else [self, self.light]

    def lane_for(self, code: str) -> _Slot:
        return self.light if self.light is not None and imports.stdlib_only(code) else self


_pool_ids = itertools.count()
UIDS_PER_POOL = 512
LANE_UIDS = 256  # the first half: one uid per zygote (a slot and its light twin)
SESSION_UIDS = UIDS_PER_POOL - LANE_UIDS  # the second half: one per live session


POOLS_PER_PROCESS = 64
# Pool indices alive in this process. Uids (and the cgroups named after them) are machine-wide, so two
# live pools must never share a range: a test suite or a service creating pool after pool would
# otherwise wrap around onto a pool that is still running.
_live_pool_indices: set[int] = set()


def _claim_pool_index() -> int:
    for _ in range(POOLS_PER_PROCESS):
        index = next(_pool_ids) % POOLS_PER_PROCESS
        if index not in _live_pool_indices:
            _live_pool_indices.add(index)
            return index
    raise RuntimeError(f"more than {POOLS_PER_PROCESS} sandbox pools alive in one process: close some first")


def _uid_base(pool_index: int) -> int:
    """First uid of a pool's zygotes; distinct for every live pool on the machine (by pid and pool index).

    Unused by any account (>= 2**20), below 2**30, room for 512 zygotes (256 slots) per pool.
    """
    return 2**20 + ((os.getpid() % 2**15) * POOLS_PER_PROCESS + pool_index) * UIDS_PER_POOL


def _no_slot(waited_s: float) -> ExecResult:
    return ExecResult(Status.QUEUE_TIMEOUT, message=f"no free slot within {waited_s:g} s")


STDLIB = "stdlib"  # a preload value: the standard-library part of zygote.PRELOAD


def stdlib_part(modules: list[str] | tuple[str, ...]) -> list[str]:
    return [m for m in modules if m.split(".")[0] in sys.stdlib_module_names]


def resolve_preload(preload: list[str] | str | None) -> list[str]:
    """The modules each slot imports at start: None is zygote.PRELOAD, "stdlib" its standard-library
    part, a list itself. A name that is not installed is a ValueError naming it (found, not imported):
    a zygote that cannot import its preload would die at start with a traceback in the log."""

    def installed(module: str) -> bool:
        try:
            return importlib.util.find_spec(module.split(".")[0]) is not None
        except ValueError:  # an empty or relative name
            return False

    if preload is None:
        return list(zygote.PRELOAD)
    if isinstance(preload, str):
        if preload != STDLIB:
            raise ValueError(f"preload: {preload!r} is neither a list of modules nor {STDLIB!r}")
        return stdlib_part(zygote.PRELOAD)
    missing = [m for m in preload if not installed(m)]
    if missing:
        raise ValueError(f"preload: no module named {', '.join(map(repr, missing))} on this machine")
    return list(preload)


def _alive(lane: _Slot) -> bool:
    return lane.proc is not None and lane.proc.returncode is None


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def _zygote_env() -> dict[str, str]:
    import tirl
    from tirl import lifetime

    return {
        **isolation.CLEAN_ENV,
        "PYTHONPATH": str(Path(tirl.__file__).parent.parent),
        "HOME": "/",
        # One malloc heap in transparent huge pages: fork copies one entry per 2 MiB instead of
        # 512, which halves the CPU cost of each call's fork and exit.
        "PYTHONMALLOC": "malloc",
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
        # tirl.lifetime: the zygote dies with the tirl command that started it and leaves Ctrl-C to it.
        **{k: v for k, v in os.environ.items() if k == lifetime.ENV},
    }


class Sandbox:
    """A pool of `slots` warm, isolated Python executors.

    async with Sandbox(slots=2) as sb:
        r = await sb.run("print(6 * 7)")

    Memory: running calls and live sessions share `memory_budget_mb` (default the machine's RAM);
    `calls_reserve_mb` of it is kept for stateless calls (default every slot at the default memory
    limit, at most half the budget), so sessions can never hold what calls need (admission.py).
    """

    def __init__(
        self,
        slots: int | None = None,
        limits: Limits | dict | None = None,
        maxima: Limits | dict | None = None,
        *,
        max_queue: int = 4096,
        queue_timeout_s: float = 60.0,
        isolate: bool = True,
        seccomp: bool = True,
        uid_base: int | None = None,
        preload: list[str] | str | None = None,
        warmup: list[str] | None = None,
        max_calls: int = 5000,
        max_growth_mb: int = 200,
        max_sessions: int = 64,
        session_idle_s: float = 600.0,
        session_cpu_s: float = 3600.0,
        memory_budget_mb: int | None = None,
        calls_reserve_mb: int | None = None,
    ) -> None:
        self.slots = slots or os.cpu_count() or 1
        self.maxima = Limits.model_validate(maxima or SERVER_MAXIMA)
        self.limits = Limits.model_validate(limits or DEFAULT_LIMITS).clamp(self.maxima)
        self.max_queue, self.queue_timeout_s = max_queue, queue_timeout_s
        self.isolate, self.seccomp = isolate, seccomp
        self._pool_index = _claim_pool_index() if uid_base is None else None
        self.uid_base = uid_base if uid_base is not None else _uid_base(self._pool_index)
        common = {
            "max_calls": max_calls,
            "max_growth_mb": max_growth_mb,
            "workdir_mb": self.limits.file_size_mb,
            **({"warmup": warmup} if warmup is not None else {}),
        }
        preload = resolve_preload(preload)
        light_preload = stdlib_part(preload)
        self._heavy_config = {**common, "preload": preload}
        # A light twin per slot only pays off when the preload holds more than the stdlib.
        self._light_config = {**common, "preload": light_preload} if light_preload != preload else None
        if max_sessions > SESSION_UIDS:
            raise ValueError(
                f"max_sessions={max_sessions} is too many: at most {SESSION_UIDS} (one uid each)"
            )
        if self._lanes() + 1 > LANE_UIDS:  # + the pool's session zygote
            raise ValueError(
                f"slots={self.slots} is too many: a pool runs at most {LANE_UIDS} zygotes, "
                f"one uid each (two per slot unless the preload is stdlib-only); use fewer slots"
            )
        self._slots: list[_Slot] = []
        self._idle: asyncio.Queue[_Slot] = asyncio.Queue()
        self._busy = 0
        self._netns_fds: list[int] = []
        self._cgroups: list[cgroups.SlotCgroup] = []
        self._mode = "none"
        self._missing: list[str] = []
        self._tasks: set[asyncio.Task] = set()
        # Sessions are forked by a zygote of their own (started on the first open), never by a
        # slot's: a slot's zygote is recycled, respawned and limited by its calls, and its fork
        # server's exit would end every session it forked.
        self._session_lane: _Slot | None = None
        budget_mb = memory_budget_mb or (host_memory_bytes() or 0) // MiB or 1 << 30
        if calls_reserve_mb is None:
            calls_reserve_mb = default_calls_reserve_mb(budget_mb, self.slots, self.limits.memory_mb)
        # One admission rule for calls and sessions (queue, session cap, memory budget).
        self.admission_rule = Admission(max_queue, max_sessions, budget_mb, calls_reserve_mb)
        self.sessions = SessionManager(
            self,
            self.admission_rule,
            first_uid=None,  # set at start, once the isolation mode is known
            uids=SESSION_UIDS,
            idle_s=session_idle_s,
            cpu_s=session_cpu_s,
        )

    # ---- lifecycle ----

    async def __aenter__(self) -> Sandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _plan_isolation(self) -> list[isolation.Plan]:
        root = os.geteuid() == 0
        if not self.isolate:
            self._mode = "disabled"
            self._missing.append("isolation disabled by configuration: code runs with the service's rights")
        elif root:
            self._mode = "root"
            cgroups.clean_stale()  # what a killed service left: frozen sessions above all
            # One empty network namespace per zygote: abstract unix sockets live in the network
            # namespace, so calls of different slots can neither connect nor pass descriptors.
            self._netns_fds = [netns.create_empty_netns(_zygote_env()) for _ in range(self._lanes())]
            self._cgroups, notes = cgroups.create_slot_cgroups(cgroups.service_name(), self._lanes())
            self._missing += notes
        elif isolation.userns_available():
            self._mode = "userns"
            self._missing += [
                "not root: no per-slot uid (code runs as the service's uid inside a user namespace)",
                "not root: no cgroup limits (memory is bounded by RLIMIT_AS only, processes by RLIMIT_NPROC per slot)",
                "not root: each slot has its own empty network namespace instead of one shared",
            ]
        else:
            self._mode = "none"
            self._missing += [
                "not root and user namespaces are disabled: NO namespaces, NO network isolation, NO read-only "
                "filesystem, NO uid drop; only rlimits, seccomp and no_new_privs protect the host",
            ]
        if not self.seccomp:
            self._missing.append("seccomp disabled by configuration")
        elif problem := seccomp_filter.available():
            self.seccomp = False
            self._missing.append(problem)
        plans = []
        for i in range(self._lanes()):
            plans.append(
                isolation.Plan(
                    uid=self.uid_base + i if self._mode == "root" else None,
                    netns_fd=self._netns_fds[i] if self._netns_fds else None,
                    userns=self._mode == "userns",
                    namespaces=self._mode in ("root", "userns"),
                    pid_namespace=self._mode in ("root", "userns"),
                    seccomp=self.seccomp,
                    cgroup=self._cgroups[i] if self._cgroups else cgroups.SlotCgroup(),
                )
            )
        return plans

    def _lanes(self) -> int:
        """Zygotes in the pool: one per slot, plus a light twin each when configured."""
        return self.slots * (1 if self._light_config is None else 2)

    async def start(self) -> None:
        plans = self._plan_isolation()
        if self._mode == "root":
            self.sessions.first_uid = self.uid_base + LANE_UIDS
        self._slots = [_Slot(i, plans[i], self._heavy_config) for i in range(self.slots)]
        if self._light_config is not None:
            for s in self._slots:
                s.light = _Slot(s.index, plans[self.slots + s.index], self._light_config)
        try:
            await asyncio.gather(*(self._spawn(lane) for s in self._slots for lane in s.lanes()))
        except BaseException:
            await self.close()
            raise
        for s in self._slots:
            self._idle.put_nowait(s)

    async def _spawn(self, slot: _Slot) -> None:
        if slot.handoff is not None:
            slot.handoff.close()
        slot.handoff, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        handoff_fd = theirs.fileno()
        pass_fds = (slot.plan.netns_fd,) if slot.plan.netns_fd is not None else ()  # kept open for respawns
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tirl.sandbox.zygote",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=_zygote_env(),
                pass_fds=(*pass_fds, handoff_fd),
                cwd="/",
            )
        finally:
            theirs.close()
        slot.proc, slot.calls = proc, 0
        config = {"plan": slot.plan.to_dict(), **slot.config, "handoff_fd": handoff_fd}
        proc.stdin.write(framing.encode(config))
        try:
            ready = await asyncio.wait_for(framing.read_frame_async(proc.stdout), START_TIMEOUT_S)
        except (asyncio.IncompleteReadError, TimeoutError) as exc:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise RuntimeError(
                f"sandbox slot {slot.index} failed to start (see the log above): {exc!r}"
            ) from None
        slot.notes = tuple(ready.get("notes", ()))

    async def close(self) -> None:
        self.admission_rule.closed = True
        for t in list(self._tasks):
            t.cancel()
        await self.sessions.close_all("the sandbox pool was closed")
        lanes = [lane for s in self._slots for lane in s.lanes()] + [
            lane for lane in (self._session_lane,) if lane is not None
        ]
        for s in lanes:
            if s.proc is not None and s.proc.returncode is None:
                s.proc.stdin.close()
        for s in lanes:
            if s.proc is not None:
                try:
                    await asyncio.wait_for(s.proc.wait(), 10)
                except TimeoutError:
                    s.proc.kill()
                    await s.proc.wait()
        cgroups.remove_slot_cgroups(self._cgroups)
        for lane in lanes:
            if lane.handoff is not None:
                lane.handoff.close()
                lane.handoff = None
        for fd in self._netns_fds:
            os.close(fd)
        self._netns_fds = []
        if self._pool_index is not None:  # its uids and cgroups are free only now
            _live_pool_indices.discard(self._pool_index)

    # ---- calls ----

    def call_limits(self, timeout: float | None = None, limits: Limits | dict | None = None) -> Limits:
        """The limits of one call: the pool's defaults, overridden per call, clamped to the maxima."""
        base = self.limits
        if limits is not None:
            given = limits.model_dump(exclude_unset=True) if isinstance(limits, Limits) else dict(limits)
            base = base.with_overrides(**given)
        return base.with_overrides(timeout_s=timeout).clamp(self.maxima)

    async def run(
        self, code: str, stdin: str = "", timeout: float | None = None, limits: Limits | dict | None = None
    ) -> ExecResult:
        """Run `code` with `stdin` in a fresh confined process of a free slot."""
        call_limits = self.call_limits(timeout, limits)
        queued = time.monotonic()
        if (refused := self.admission()) is not None:
            return refused
        slot = await self._acquire(self.queue_timeout_s)
        if slot is None:
            return _no_slot(self.queue_timeout_s)
        if (why := self.admission_rule.reserve_call(call_limits.memory_mb)) is not None:
            self._idle.put_nowait(slot)
            return ExecResult(Status.QUEUE_TIMEOUT, message=why)
        queue_ms = (time.monotonic() - queued) * 1000
        self._busy += 1
        healthy, lane = False, slot.lane_for(code)
        try:
            result, healthy = await self._call(lane, code, stdin, call_limits)
        finally:
            self._busy -= 1
            self.admission_rule.release_call(call_limits.memory_mb)
            if healthy:
                self._idle.put_nowait(slot)
            else:
                self._respawn_later(slot, lane)
        result.extra["queue_ms"] = round(queue_ms, 2)
        return result

    def admission(self) -> ExecResult | None:
        """Why a call or cell cannot even queue (closed pool, queue full), or None: answered at once,
        before the caller waits (the server asks before it parses a request's body)."""
        return self.admission_rule.queue_refusal()

    async def _acquire(self, timeout: float) -> _Slot | None:
        """A free slot, or None after `timeout` seconds (counted as waiting in the queue)."""
        with contextlib.suppress(asyncio.QueueEmpty):
            return self._idle.get_nowait()
        self.admission_rule.waiting += 1
        try:
            return await asyncio.wait_for(self._idle.get(), max(timeout, 0.0))
        except TimeoutError:
            return None
        finally:
            self.admission_rule.waiting -= 1

    async def acquire_slot(self, timeout: float) -> _Slot | None:
        """A free slot for a session's cell (counted busy until `release_slot`), or None after `timeout`."""
        slot = await self._acquire(timeout)
        if slot is not None:
            self._busy += 1
        return slot

    def release_slot(self, slot: _Slot) -> None:
        self._busy -= 1
        self._idle.put_nowait(slot)

    # ---- persistent sessions (session_manager.py) ----

    async def open_session(self, limits: Limits | dict | None = None) -> Session:
        """A live interpreter that keeps its state across `session.run` calls (close it when done).

        Raises SessionError when the pool is closed, at its cap of sessions (live or opening), out
        of the sessions' memory share, or cannot start one.
        """
        return await self.sessions.open(self.call_limits(None, limits))

    def session(self, session_id: str) -> Session | None:
        return self.sessions.get(session_id)

    async def run_in_session(
        self, session: Session, code: str, stdin: str = "", timeout: float | None = None
    ) -> ExecResult:
        return await self.sessions.run_in_session(session, code, stdin, timeout)

    async def close_session(self, session: Session | str) -> bool:
        return await self.sessions.close_session(session)

    async def session_zygote(self) -> _Slot:
        """The zygote that forks sessions (for the session manager), started on first use (and again
        if it died)."""
        if self._session_lane is None:
            config = {**self._heavy_config, "max_calls": 1 << 62, "max_growth_mb": 1 << 20}  # never recycled
            self._session_lane = _Slot(self.slots, self._session_plan(), config)
        lane = self._session_lane
        if not _alive(lane):
            if lane.proc is not None:
                await lane.proc.wait()
            await self._spawn(lane)
        return lane

    def _session_plan(self) -> isolation.Plan:
        """A slot's isolation, with a uid, network namespace and (unlimited) cgroup of its own: no
        call's limits apply to the process that forks sessions, each session gets its own cgroup."""
        root = self._mode == "root"
        netns_fd, group = None, cgroups.SlotCgroup()
        if root:
            netns_fd = netns.create_empty_netns(_zygote_env())
            self._netns_fds.append(netns_fd)
            groups, _ = cgroups.create_slot_cgroups(cgroups.service_name(), 1)
            group = groups[0]
            self._cgroups.append(group)
        return dataclasses.replace(
            self._slots[0].plan,
            uid=self.uid_base + self._lanes() if root else None,
            netns_fd=netns_fd,
            cgroup=group,
        )

    async def _call(self, slot: _Slot, code: str, stdin: str, limits: Limits) -> tuple[ExecResult, bool]:
        proc = slot.proc
        try:
            proc.stdin.write(framing.encode({"code": code, "stdin": stdin, "limits": limits.model_dump()}))
            reply = await asyncio.wait_for(framing.read_frame_async(proc.stdout), limits.timeout_s + GRACE_S)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError) as exc:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            reason = "did not answer in time" if isinstance(exc, TimeoutError) else "died"
            return ExecResult(Status.SANDBOX_ERROR, message=f"sandbox slot {slot.index} {reason}"), False
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()  # the caller gave up mid-call: the slot's protocol state is unknown
            raise
        slot.calls += 1
        return ExecResult.from_dict(reply["result"]), not reply.get("recycle")

    def _respawn_later(self, slot: _Slot, lane: _Slot) -> None:
        """Replace `lane` (the slot's zygote or its light twin), then offer the slot again."""

        async def respawn() -> None:
            delay = 0.5
            if lane.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    lane.proc.kill()
                await lane.proc.wait()
            while not self.admission_rule.closed:
                try:
                    await self._spawn(lane)
                    self._idle.put_nowait(slot)
                    return
                except RuntimeError:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 30)

        task = asyncio.create_task(respawn())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run_batch(self, calls: list[dict]) -> list[ExecResult]:
        """Run many calls ({code, stdin?, timeout?, limits?}) concurrently; results in order."""
        return list(await asyncio.gather(*(self.run(**c) for c in calls)))

    # ---- introspection ----

    @property
    def uids(self) -> list[int]:
        """The zygotes' uids (their calls run as these)."""
        return [lane.plan.uid for s in self._slots for lane in s.lanes() if lane.plan.uid is not None]

    @property
    def session_uids(self) -> list[int]:
        """Every uid a session of this pool may run as."""
        if self._mode != "root":
            return []
        return list(range(self.uid_base + LANE_UIDS, self.uid_base + UIDS_PER_POOL))

    def features(self) -> dict:
        """Which isolation features are active in this pool, and what is missing."""
        root, ns = self._mode == "root", self._mode in ("root", "userns")
        cg = self._cgroups[0] if self._cgroups else cgroups.SlotCgroup()
        notes = sorted({n for s in self._slots for lane in s.lanes() for n in lane.notes})
        active = {
            "mode": self._mode,
            "new_session": True,
            "die_with_parent": True,
            "pid_namespace": ns,
            "mount_namespace": ns,
            "ipc_namespace": ns,
            "uts_namespace": ns,
            "network": "per-slot empty netns" if ns else "host network",
            "allowlisted_root": ns,
            "readonly_root": ns,
            "tmpfs_workdir": ns,
            "per_slot_uid": root,
            "no_new_privs": True,
            "seccomp_denylist": self.seccomp,
            "rlimits": ["CPU", "FSIZE", "NOFILE", "CORE", "AS", *(["NPROC"] if ns else [])],
            "cgroup_memory": cg.memory_dir is not None,
            "cgroup_pids": cg.pids_dir is not None,
            "cgroup_cpu_quota": cg.cpu_dir is not None,  # at most one CPU per slot
            "starvation_detection": cg.cpuacct_dir is not None,
        }
        return {"active": active, "missing": self._missing + notes}

    def health(self) -> dict:
        alive = sum(1 for s in self._slots if all(_alive(lane) for lane in s.lanes()))
        zygotes = [lane.proc.pid for s in self._slots for lane in s.lanes() if _alive(lane)]
        return {
            "service_pid": os.getpid(),
            "service_rss_mb": round(_rss_mb(os.getpid()), 1),
            "zygote_rss_mb": [round(_rss_mb(pid), 1) for pid in zygotes],
            "slots": self.slots,
            "alive": alive,
            "idle": self._idle.qsize(),
            "busy": self._busy,
            "queued": self.admission_rule.waiting,
            "max_queue": self.max_queue,
            "features": self.features(),
            "sessions": len(self.sessions.live),
            "sessions_held": self.admission_rule.sessions_held,
            "max_sessions": self.admission_rule.max_sessions,
            "memory_reserved_mb": self.admission_rule.reserved_mb,
            "memory_reserved_by_sessions_mb": self.admission_rule.sessions_mb,
            "memory_budget_mb": self.admission_rule.budget_mb,
            "memory_kept_for_calls_mb": self.admission_rule.calls_reserve_mb,
            "limits": self.limits.model_dump(),
            "maxima": self.maxima.model_dump(),
        }
