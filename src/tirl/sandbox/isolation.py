"""Linux isolation: what the zygote sets up once, and what each call's child sets up before user code.

Zygote (once): join its slot's empty network namespace (abstract unix sockets are per network
namespace, so calls of different slots cannot meet), enter a private mount namespace whose root is
built from an allowlist (a tmpfs holding read-only binds of /usr, the Python runtime, a few /etc
files and harmless devices: no home directories, no data, no /sys, no ptys); its fork server joins
the slot's cgroups after warm-up, so every child is born inside them.
Call (per fork, before the code arrives): pid 1 of a new pid namespace, new mount/ipc/uts
namespaces, fresh /proc and size-capped tmpfs workdir and /dev/shm, unprivileged per-slot uid,
no_new_privs, seccomp denylist; once the call arrives, its rlimits.
"""

from __future__ import annotations

import functools
import os
import resource
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tirl import linux
from tirl.sandbox import seccomp_filter
from tirl.sandbox.cgroups import SlotCgroup

if TYPE_CHECKING:
    from collections.abc import Callable

    from tirl.sandbox.limits import Limits

# Not imported from limits.py: the zygote must not load pydantic (a bigger image to fork per call).
MiB = 1 << 20

WORKDIR = "/tmp"
HOSTNAME = "sandbox"
_KEEP_FLAGS = {
    "nosuid": linux.MS_NOSUID, "nodev": linux.MS_NODEV, "noexec": linux.MS_NOEXEC,
    "noatime": 1 << 10, "nodiratime": 1 << 11, "relatime": 1 << 21,
}  # fmt: skip
CLEAN_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8",
    "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1", "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1", "MPLBACKEND": "Agg",
    # One string hash for every run: a printed set of strings comes out in one order, so a seed
    # reproduces its trajectories (hash flooding is no threat to code that already runs here).
    "PYTHONHASHSEED": "0",
}  # fmt: skip


@dataclass
class Plan:
    """What isolation a slot applies; decided by the pool, carried out by the zygote."""

    uid: int | None = None  # per-slot uid to drop to (root only)
    netns_fd: int | None = None  # the shared empty network namespace (root only)
    userns: bool = False  # unprivileged: a user namespace provides the other namespaces
    namespaces: bool = True
    # Each call is pid 1 of its own pid namespace. Unprivileged, the fork server is first made pid 1
    # of a pid namespace our user namespace owns (zygote.py), so it may point its children back at it.
    pid_namespace: bool = True
    seccomp: bool = True
    cgroup: SlotCgroup = field(default_factory=SlotCgroup)
    runtime_paths: list[str] = field(default_factory=list)
    interpreter: list[str] = field(default_factory=list)  # `interpreter_paths`, as user code sees them
    own_network: bool = False  # a network namespace of its own (sessions; calls share their slot's)

    @property
    def runtime_under_workdir(self) -> list[str]:
        return _runtime_under(tuple(self.runtime_paths), tuple(self.interpreter), WORKDIR)

    def to_dict(self) -> dict:
        return {**self.__dict__, "cgroup": self.cgroup.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        return cls(**{**d, "cgroup": SlotCgroup.from_dict(d["cgroup"])})


_USERNS_PROBE = "import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare(0x10000000) != 0)"


def userns_available() -> bool:
    """Whether this process's user may create user namespaces: the kernel's knobs allow it and a
    child that tries succeeds (a container's seccomp profile or an LSM can refuse what they allow)."""
    knobs = {"/proc/sys/user/max_user_namespaces": "0", "/proc/sys/kernel/unprivileged_userns_clone": "0"}
    for path, off in knobs.items():
        try:
            if Path(path).read_text().strip() == off:
                return False
        except OSError:
            pass
    import subprocess  # here, not at the top: the zygotes import this module
    import sys

    try:
        return subprocess.run([sys.executable, "-S", "-c", _USERNS_PROBE], timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# ---- zygote: once per slot ----


def _enter_userns() -> None:
    uid, gid = os.getuid(), os.getgid()
    linux.unshare(linux.CLONE_NEWUSER | linux.CLONE_NEWNS | linux.CLONE_NEWNET)
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
    Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")


# What exists inside the sandbox; everything else of the host does not (hidden files cannot leak).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/nsswitch.conf")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
DEV_LINKS = {
    "/dev/fd": "/proc/self/fd",
    "/dev/stdin": "/proc/self/fd/0",
    "/dev/stdout": "/proc/self/fd/1",
    "/dev/stderr": "/proc/self/fd/2",
}
EMPTY_DIRS = ("/proc", WORKDIR, "/dev/shm", "/etc", "/var/tmp")
PASSWD = "root:x:0:0:root:/root:/usr/sbin/nologin\nsandbox:x:{uid}:{uid}:sandbox:/tmp:/usr/sbin/nologin\n"
GROUP = "root:x:0:\nsandbox:x:{uid}:\n"
NEW_ROOT = WORKDIR  # where the new root is assembled before pivot_root (inside our private mount namespace)
_ST_TO_MS = {
    1: linux.MS_RDONLY,
    2: linux.MS_NOSUID,
    4: linux.MS_NODEV,
    8: linux.MS_NOEXEC,
    1024: 1 << 10,
    2048: 1 << 11,
    4096: 1 << 21,
}


def _within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _outermost(paths: list[str]) -> list[str]:
    """The paths not inside another one of them, resolved (binding those binds the rest)."""
    real = sorted({os.path.realpath(p) for p in paths if os.path.exists(p)})
    out: list[str] = []
    for p in real:
        if not any(_within(p, o) for o in out):
            out.append(p)
    return out


def runtime_paths() -> list[str]:
    """What imports need inside the sandbox, and nothing more of the host: the standard library (with
    its extension modules), site-packages, the interpreter's shared library, and of tirl only the
    sandbox package and the tirl modules it loaded. Not the project tree (reward code, data), the
    venv's scripts or the rest of the interpreter's directory (see `_build_root` for tirl itself
    when it is installed inside site-packages)."""
    import sys
    import sysconfig

    wanted = [sysconfig.get_paths()["stdlib"], sysconfig.get_config_var("DESTSHARED") or ""]
    wanted += [p for p in sys.path if os.path.basename(p.rstrip("/")) in ("site-packages", "dist-packages")]
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and os.path.isfile(os.path.join(libdir, soname)):
        wanted.append(os.path.join(libdir, soname))
    # tirl's files stay separate even inside site-packages: _build_root binds only them of the package
    return _outermost([p for p in wanted if p and os.path.exists(p)]) + own_package_paths()


def interpreter_paths() -> list[str]:
    """The interpreter as user code finds it: `sys.executable` (a venv's symlink is bound as the binary
    it points to, at the same path) and the venv's pyvenv.cfg, so `subprocess.run([sys.executable,
    ...])` and multiprocessing's spawn and forkserver start this Python with the same packages."""
    import sys

    paths = [sys.executable] if sys.executable else []
    if sys.prefix != sys.base_prefix:
        paths.append(os.path.join(sys.prefix, "pyvenv.cfg"))
    return [os.path.abspath(p) for p in paths if os.path.isfile(p)]


def own_package_paths() -> list[str]:
    """The files of tirl the sandbox runs on: its own package and the tirl modules loaded so far."""
    import sys

    sandbox = os.path.dirname(os.path.abspath(__file__))
    loaded = [getattr(m, "__file__", None) for n, m in list(sys.modules.items()) if n.split(".")[0] == "tirl"]
    return _outermost([sandbox] + [f for f in loaded if f and not _within(os.path.abspath(f), sandbox)])


def _package_root() -> str:
    """The directory of the tirl package (hidden but for `own_package_paths`)."""
    return os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.lru_cache(maxsize=8)  # fixed per zygote: computed once, not per call
def _runtime_under(paths: tuple[str, ...], interpreter: tuple[str, ...], top: str) -> list[str]:
    """The outermost runtime paths inside `top` (e.g. a checkout and its venv under /tmp): a tmpfs on
    `top` would hide them, and lazy imports (numpy.random, ...) would fail inside the call. The
    interpreter's paths stay unresolved (a venv's python is a symlink to outside it)."""
    inside = [p for p in _outermost(list(paths)) if p != top and _within(p, top)]
    return inside + [p for p in interpreter if _within(p, top) and not any(_within(p, q) for q in inside)]


def _mount_flags(path: str) -> int:
    """The flags of the mount holding `path`: a read-only remount must keep the locked ones (userns)."""
    flags = os.statvfs(path).f_flag
    return sum(ms for st, ms in _ST_TO_MS.items() if flags & st)


def _bind_readonly(fd: int, target: str, flags: int = 0) -> None:
    linux.mount(f"/proc/self/fd/{fd}", target, None, linux.MS_BIND | linux.MS_REC)
    linux.mount(None, target, None, linux.MS_REMOUNT | linux.MS_BIND | linux.MS_RDONLY | flags)
    os.close(fd)


def _build_root(runtime: list[str], interpreter: list[str], uid: int | None, own_proc: bool) -> None:
    """Assemble the sandbox's filesystem from an allowlist in a tmpfs, then make it our root.

    Read-only binds of the system directories, the Python runtime (`runtime_paths`: stdlib,
    site-packages, tirl.sandbox), a few /etc files and device nodes; an empty /tmp, /dev/shm and
    /proc for each call's own mounts. Nothing else of the host (home directories, data, the
    project's runs, the rest of the project's code) exists inside.
    """
    links = {p: os.readlink(p) for p in SYSTEM_DIRS if os.path.islink(p)}
    package = _package_root()
    pieces = [p for p in runtime if _within(p, package)]  # tirl's own files: bound after the mask
    outer = _outermost([p for p in (*SYSTEM_DIRS, *runtime) if p not in links and p not in pieces])
    dirs = [p for p in outer if os.path.isdir(p)]
    # the interpreter at the path user code knows (unresolved), unless a bound directory shows it already
    shown = [p for p in interpreter if not any(_within(p, d) for d in (*dirs, *links))]
    files = [
        p
        for p in (*ETC_FILES, *DEVICES, *(p for p in outer if not os.path.isdir(p)), *shown)
        if os.path.exists(p)
    ]
    sources = {p: (os.open(p, os.O_PATH | os.O_CLOEXEC), _mount_flags(p)) for p in (*dirs, *files, *pieces)}
    linux.mount("tmpfs", NEW_ROOT, "tmpfs", linux.MS_NOSUID, "size=4m,mode=0755")
    root = lambda p: NEW_ROOT + p  # noqa: E731
    for d in (*EMPTY_DIRS, *dirs):
        os.makedirs(root(d), mode=0o755, exist_ok=True)
    os.chmod(root(WORKDIR), 0o1777)
    for p in files:
        _mountpoint(root(p), directory=False)
    for p, target in {**links, **DEV_LINKS}.items():
        os.symlink(target, root(p))
    Path(root("/etc/passwd")).write_text(PASSWD.format(uid=uid if uid is not None else 65534))
    Path(root("/etc/group")).write_text(GROUP.format(uid=uid if uid is not None else 65534))
    Path(root("/etc/hostname")).write_text(HOSTNAME + "\n")
    for p in (*dirs, *files):
        fd, flags = sources[p]
        _bind_readonly(fd, root(p), flags)
    _bind_own_package(
        package, pieces, {p: sources[p] for p in pieces}, root, masked=any(_within(package, d) for d in dirs)
    )
    if own_proc:  # the zygote's own view of processes; each call mounts the proc of its pid namespace
        linux.mount("proc", root("/proc"), "proc", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
    else:  # in a user namespace without a pid namespace, proc can only be bound
        linux.mount("/proc", root("/proc"), None, linux.MS_BIND | linux.MS_REC)
    linux.mount(None, NEW_ROOT, None, linux.MS_REMOUNT | linux.MS_RDONLY | linux.MS_NOSUID)
    os.chdir(NEW_ROOT)
    linux.pivot_root(".", ".")  # the old root ends up stacked below the new one ...
    linux.umount(".")  # ... and is detached here
    os.chdir("/")


def _mountpoint(path: str, directory: bool) -> None:
    if directory:
        os.makedirs(path, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))


def _bind_own_package(
    package: str,
    pieces: list[str],
    sources: dict[str, tuple[int, int]],
    root: Callable[[str], str],
    masked: bool,
) -> None:
    """Only tirl's sandbox files of the package: an empty directory holding binds of them (a tmpfs
    over the package when it sits inside a bound directory, e.g. installed into site-packages)."""
    target = root(package)
    if masked:
        linux.mount("tmpfs", target, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "size=1m,mode=0755")
    for p in pieces:  # through the fd: the tmpfs the root is built in may hide p (a checkout under /tmp)
        _mountpoint(root(p), directory=os.path.isdir(f"/proc/self/fd/{sources[p][0]}"))
    for p in pieces:
        fd, flags = sources[p]
        _bind_readonly(fd, root(p), flags)
    if masked:
        linux.mount(None, target, None, linux.MS_REMOUNT | linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV)


def isolate_zygote(plan: Plan) -> list[str]:
    """Enter the slot's long-lived namespaces and its allowlisted root; returns notes about gaps."""
    notes: list[str] = []
    plan.cgroup.open()  # before /sys/fs/cgroup disappears from our view
    if not plan.namespaces:
        return notes
    if plan.userns:
        _enter_userns()
    else:
        if plan.netns_fd is not None:
            linux.setns(plan.netns_fd, linux.CLONE_NEWNET)
            os.close(plan.netns_fd)
        linux.unshare(linux.CLONE_NEWNS)
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    plan.runtime_paths, plan.interpreter = runtime_paths(), interpreter_paths()
    _build_root(plan.runtime_paths, plan.interpreter, plan.uid, own_proc=not plan.userns)
    return notes


def protect_from_oom_killer() -> str | None:
    """The fork server shares its slot's memory cgroup with the call: the OOM killer must pick the call.

    Needs CAP_SYS_RESOURCE; returns what is missing when it fails (then only the calls' own
    maximal scores steer the OOM killer). Each call raises its own score to the maximum.
    """
    try:
        Path("/proc/self/oom_score_adj").write_text("-1000")
    except OSError as exc:
        return (
            f"zygotes are not protected from the OOM killer ({exc.strerror}): a call's OOM may kill a zygote"
        )
    return None


# ---- call: once per fork, in the child, before user code ----


def nproc_others(plan: Plan) -> int | None:
    """How many processes outside the call count against its RLIMIT_NPROC (None: no such limit).

    A per-slot uid counts exactly the call's processes. Unprivileged, the count is per user in the
    slot's own user namespace: the slot's supervisor and fork server (and live sessions) share it.
    """
    if plan.uid is not None:
        return 0
    return 2 if plan.userns else None


def apply_limits(limits: Limits, address_space: int, nproc_others: int | None) -> None:
    """The call's rlimits (lowering needs no privilege, so this runs after the uid drop)."""
    cpu = int(limits.timeout_s) + 1
    fsize = limits.file_size_mb * MiB
    values = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU first, SIGKILL one second later
        (resource.RLIMIT_FSIZE, (fsize, fsize)),
        (resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files)),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_AS, (address_space, address_space)),
    ]
    if nproc_others is not None:
        nproc = limits.max_procs + nproc_others
        values.append((resource.RLIMIT_NPROC, (nproc, nproc)))
    for which, value in values:
        resource.setrlimit(which, value)


def clean_environment() -> None:
    """Replace this process's environment by CLEAN_ENV (the fork server, once: its calls inherit it)."""
    os.environ.clear()
    os.environ.update(CLEAN_ENV)


def confine_call(plan: Plan, seccomp: linux.SockFprog | None, workdir_mb: int) -> None:
    """Confine a freshly forked call process (pid 1 of its own pid namespace) before its call arrives.

    Every Python object touched here costs the call a copy-on-write page of the fork server's
    image: plain os calls, no pathlib or text files (the environment is the fork server's, clean).
    """
    os.setsid()
    linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
    # The zygote's heap sits in huge pages (cheap fork); user code's own allocations use small
    # pages, so its page faults never wait for huge-page compaction.
    linux.prctl(linux.PR_SET_THP_DISABLE, 1)
    if plan.namespaces:
        own_net = linux.CLONE_NEWNET if plan.own_network else 0
        linux.unshare(linux.CLONE_NEWNS | linux.CLONE_NEWIPC | linux.CLONE_NEWUTS | own_net)
        linux.sethostname(HOSTNAME)
        if plan.pid_namespace:  # a proc of our own pid namespace: the call sees only its processes
            linux.mount("proc", "/proc", "proc", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
        keep = {p: os.open(p, os.O_PATH) for p in plan.runtime_under_workdir}
        size = f"size={workdir_mb}m,mode=1777"
        for target in (WORKDIR, "/dev/shm"):
            linux.mount("tmpfs", target, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, size)
        for path, fd in keep.items():  # runtime living under the workdir: visible again, read-only
            _mountpoint(path, directory=os.path.isdir(f"/proc/self/fd/{fd}"))
            _bind_readonly(fd, path, _mount_flags(f"/proc/self/fd/{fd}"))
    if plan.cgroup.active:
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)  # the zygote shares the cgroup: kill us first
        os.write(fd, b"1000")
        os.close(fd)
    if plan.userns:  # the zygote's user namespace gave us every capability in it: keep none
        linux.drop_capabilities()
    if plan.uid is not None:
        os.setgroups([])
        os.setresgid(plan.uid, plan.uid, plan.uid)
        os.setresuid(plan.uid, plan.uid, plan.uid)
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)  # a uid change clears it: set it again
    linux.prctl(linux.PR_SET_NO_NEW_PRIVS, 1)
    if seccomp is not None:
        seccomp_filter.install(seccomp)
    os.chdir(WORKDIR if plan.namespaces else "/")
