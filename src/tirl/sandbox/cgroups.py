"""Per-slot cgroups: memory, process-count and CPU limits on everything one call spawns.

Supports cgroup v1 (memory, pids, cpu and cpuacct hierarchies, as on this machine) and v2 where
our cgroup may have children. Slot groups are nested under the service's own cgroup so whoever
limits the service also limits its sandboxes. Each slot gets at most one CPU (a CFS quota), so a
call that spawns busy processes cannot starve the calls of other slots; the slot's CPU usage tells
a starved call (little CPU in a long wall time) from one that spent its time computing.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PREFIX = "tirl-sandbox-"  # service groups are named PREFIX<n>-<pid>
_pools = itertools.count()


def service_name() -> str:
    """A cgroup name unique to this pool: several pools may live in one process."""
    return f"{PREFIX}{next(_pools)}-{os.getpid()}"


def _own_paths() -> dict[str, str]:
    """controller -> our cgroup path, from /proc/self/cgroup ('' key = cgroup v2)."""
    paths = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            paths[c] = path
    return paths


@dataclass
class SlotCgroup:
    """The cgroup directories of one slot; empty when the kernel offers no usable cgroup.

    The zygote opens the files it needs once (`open`), before its view of /sys/fs/cgroup becomes
    read-only; writes through descriptors opened earlier keep working.
    """

    memory_dir: str | None = None
    pids_dir: str | None = None
    cpu_dir: str | None = None
    cpuacct_dir: str | None = None
    v2: bool = False
    freezer_dir: str | None = None  # sessions only: frozen between their cells
    _fds: dict = field(default_factory=dict)
    _written: dict = field(default_factory=dict)

    @property
    def active(self) -> list[str]:
        named = (("memory", self.memory_dir), ("pids", self.pids_dir), ("cpu", self.cpu_dir))
        return [n for n, d in named if d]

    def dirs(self) -> list[str]:
        return list(
            dict.fromkeys(
                d
                for d in (self.memory_dir, self.pids_dir, self.cpu_dir, self.cpuacct_dir, self.freezer_dir)
                if d
            )
        )

    def _files(self) -> dict[str, tuple[str, int]]:
        files = {f"procs:{d}": (f"{d}/cgroup.procs", os.O_WRONLY) for d in self.dirs()}
        if self.memory_dir:
            names = (
                ("memory.max", "memory.events")
                if self.v2
                else ("memory.limit_in_bytes", "memory.oom_control")
            )
            files["memory_limit"] = (f"{self.memory_dir}/{names[0]}", os.O_WRONLY)
            files["oom"] = (f"{self.memory_dir}/{names[1]}", os.O_RDONLY)
            usage = "memory.current" if self.v2 else "memory.usage_in_bytes"
            files["memory_usage"] = (f"{self.memory_dir}/{usage}", os.O_RDONLY)
        if self.pids_dir:
            files["pids_max"] = (f"{self.pids_dir}/pids.max", os.O_WRONLY)
        if self.cpuacct_dir:
            usage = "cpu.stat" if self.v2 else "cpuacct.usage"
            files["cpu_usage"] = (f"{self.cpuacct_dir}/{usage}", os.O_RDONLY)
        if self.freezer_dir:
            state = "cgroup.freeze" if self.v2 else "freezer.state"
            files["freeze"] = (f"{self.freezer_dir}/{state}", os.O_WRONLY)
        return files

    def open(self) -> None:
        self._fds = {key: os.open(path, flags | os.O_CLOEXEC) for key, (path, flags) in self._files().items()}

    def _write(self, key: str, value: str) -> None:
        if key in self._fds and self._written.get(key) != value:
            os.write(self._fds[key], value.encode())
            self._written[key] = value

    def set_limits(self, memory_bytes: int, max_procs: int) -> None:
        self._write("memory_limit", str(memory_bytes))
        self._write("pids_max", str(max_procs))

    def freeze(self, frozen: bool) -> None:
        """Stop (or resume) every process of the group, whatever it does; no-op without a freezer."""
        if "freeze" in self._fds:
            state = (b"1" if frozen else b"0") if self.v2 else (b"FROZEN" if frozen else b"THAWED")
            os.write(self._fds["freeze"], state)

    def join(self, pid: int | None = None) -> None:
        """Move a process (default: the caller) into the groups; its future children are born there."""
        for key, fd in self._fds.items():
            if key.startswith("procs:"):
                os.write(fd, str(pid or os.getpid()).encode())

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def oom_kills(self) -> int:
        """How many processes the kernel killed for memory in this slot so far."""
        if "oom" not in self._fds:
            return 0
        for line in os.pread(self._fds["oom"], 4096, 0).decode().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def memory_bytes(self) -> int | None:
        """The memory the group's processes use now, page cache and tmpfs included (None: no memory
        cgroup)."""
        if "memory_usage" not in self._fds:
            return None
        return int(os.pread(self._fds["memory_usage"], 64, 0))

    def cpu_ns(self) -> int | None:
        """CPU time used by the slot's processes so far (None without CPU accounting)."""
        if "cpu_usage" not in self._fds:
            return None
        text = os.pread(self._fds["cpu_usage"], 4096, 0).decode()
        if not self.v2:
            return int(text)
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) * 1000
        return None

    def to_dict(self) -> dict:
        return {
            "memory_dir": self.memory_dir,
            "pids_dir": self.pids_dir,
            "cpu_dir": self.cpu_dir,
            "cpuacct_dir": self.cpuacct_dir,
            "v2": self.v2,
            "freezer_dir": self.freezer_dir,
        }

    @classmethod
    def from_dict(cls, d: dict) -> SlotCgroup:
        return cls(**d)


CPU_PERIOD_US = 100_000


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError:
        return False


def _mkdir(path: Path) -> str | None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        return str(path)
    except OSError:
        return None


def _remove_stale(parent: Path) -> None:
    """Remove empty slot groups left by services that died without cleaning up (named by their pid)."""
    for d in parent.glob(f"{PREFIX}*"):
        pid = d.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            for path in [*d.glob("slot*"), d]:
                with contextlib.suppress(OSError):
                    path.rmdir()


STALE_EXIT_S = 5.0  # how long a killed stale process may take to leave its group


def _dead_service(group: Path) -> bool:
    """A service group (PREFIX<n>-<pid>) whose process is gone."""
    pid = group.name.rsplit("-", 1)[-1]
    return pid.isdigit() and not Path(f"/proc/{pid}").exists()


def _end_processes(group: Path) -> None:
    """Thaw a group, then SIGKILL what is in it: a frozen process cannot act on a signal (cgroup v1),
    so the parent-death signal its fork server's death queued never ran."""
    for name, thawed in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
        if (group / name).exists():
            _write(group / name, thawed)
    if (group / "cgroup.kill").exists() and _write(group / "cgroup.kill", "1"):
        return
    with contextlib.suppress(OSError, ValueError):
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def clean_stale() -> int:
    """End and remove what services that died without cleaning up left in our hierarchies (start-up).

    Sessions frozen between cells outlive a service that was SIGKILLed or OOM-killed; every group
    of a dead service (named by its pid) is thawed, its processes killed, then removed. Returns how
    many groups were removed.
    """
    own = _own_paths()
    parents = (
        [ROOT / own.get("", "/").lstrip("/")]
        if (ROOT / "cgroup.controllers").exists()
        else [ROOT / c / p.lstrip("/") for c, p in own.items() if c and (ROOT / c).is_dir()]
    )
    # the freezer first: its processes must be thawed before any other hierarchy can see them exit
    parents.sort(key=lambda p: "freezer" not in p.parts)
    stale = [d for parent in parents for d in parent.glob(f"{PREFIX}*") if _dead_service(d)]
    leaves = [leaf for d in stale for leaf in d.glob("slot*")]
    for leaf in leaves:
        _end_processes(leaf)
    removed = 0
    deadline = time.monotonic() + STALE_EXIT_S
    for path in [*leaves, *stale]:
        while True:
            try:
                path.rmdir()
                removed += 1
                break
            except FileNotFoundError:
                break
            except OSError:  # still holds exiting processes
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
    return removed


def _create_v2(base: Path, slots: int, notes: list[str], freezer: bool) -> list[SlotCgroup]:
    """cgroup v2: works where our cgroup may delegate memory and pids to children."""
    _remove_stale(base.parent)
    try:
        base.mkdir(parents=True, exist_ok=True)
        (base / "cgroup.subtree_control").write_text("+memory +pids")
    except OSError as e:
        notes.append(f"cgroup v2: cannot delegate memory/pids below {base.parent} ({e.strerror})")
        return [SlotCgroup() for _ in range(slots)]
    cpu = True
    try:
        (base / "cgroup.subtree_control").write_text("+cpu")
    except OSError as e:
        cpu = False
        notes.append(
            f"cgroup v2: cannot delegate cpu below {base.parent} ({e.strerror}): no CPU quota per slot"
        )
    dirs = [_mkdir(base / f"slot{i}") for i in range(slots)]
    if cpu:  # the service's group weighs as much as its slots would as plain processes
        _write(base / "cpu.weight", str(min(10000, 100 * slots)))
    groups = []
    for d in dirs:
        if d and cpu and _write(Path(d) / "cpu.max", f"{CPU_PERIOD_US} {CPU_PERIOD_US}"):
            groups.append(SlotCgroup(d, d, d, d, v2=True, freezer_dir=d if freezer else None))
        else:
            groups.append(
                SlotCgroup(d, d, v2=True, freezer_dir=d if freezer else None) if d else SlotCgroup()
            )
    return groups


def _create_v1(
    own: dict[str, str], service: str, slots: int, notes: list[str], freezer: bool
) -> list[SlotCgroup]:
    """cgroup v1: one directory per slot in the memory and in the pids hierarchy."""
    per_controller = {}
    for controller in ("memory", "pids", "cpu", "cpuacct", *(["freezer"] if freezer else [])):
        if controller in own and (ROOT / controller).is_dir():
            base = ROOT / controller / own[controller].lstrip("/") / service
            _remove_stale(base.parent)
            per_controller[controller] = [_mkdir(base / f"slot{i}") for i in range(slots)]
        if not any(per_controller.get(controller, [])):
            notes.append(f"cgroup {controller} controller unavailable (not mounted or not writable)")
    cpu = per_controller.get("cpu", [None] * slots)
    if any(cpu):  # the service's group weighs as much as its slots would as plain processes
        _write(ROOT / "cpu" / own["cpu"].lstrip("/") / service / "cpu.shares", str(1024 * slots))
    for i, d in enumerate(cpu):  # one CPU per slot at most
        if d and not (
            _write(Path(d) / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            and _write(Path(d) / "cpu.cfs_quota_us", str(CPU_PERIOD_US))
        ):
            cpu[i] = None
    memory, pids, cpuacct, frozen = (
        per_controller.get(c, [None] * slots) for c in ("memory", "pids", "cpuacct", "freezer")
    )
    return [
        SlotCgroup(m, p, c, a, freezer_dir=f)
        for m, p, c, a, f in zip(memory, pids, cpu, cpuacct, frozen, strict=True)
    ]


def create_slot_cgroups(
    service: str, slots: int, freezer: bool = False
) -> tuple[list[SlotCgroup], list[str]]:
    """Create one cgroup per slot below our own; returns them and notes about what is unavailable.

    `freezer`: also a freezer group (sessions, frozen between cells).
    """
    notes: list[str] = []
    own = _own_paths()
    if (ROOT / "cgroup.controllers").exists():  # pure cgroup v2
        return _create_v2(ROOT / own.get("", "/").lstrip("/") / service, slots, notes, freezer), notes
    return _create_v1(own, service, slots, notes, freezer), notes


def remove_slot_cgroups(groups: list[SlotCgroup]) -> None:
    """Remove the slot groups and their parents (best effort: empty groups only)."""
    for g in groups:
        for d in set(g.dirs()):
            for path in (Path(d), Path(d).parent):
                with contextlib.suppress(OSError):
                    path.rmdir()
