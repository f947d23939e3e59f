"""Thin ctypes bindings for the Linux calls Python 3.11 lacks (unshare, setns, mount, prctl): used by the
sandbox's isolation and by tirl.lifetime (parent-death signal)."""

from __future__ import annotations

import ctypes
import os

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2

PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_THP_DISABLE = 41
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2

# The libc Python itself is linked against (no ctypes.util: it drags subprocess into the zygotes).
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _check(_libc.mount(enc(source), target.encode(), enc(fstype), flags, enc(data)), f"mount {target}")


def umount(target: str) -> None:
    _check(_libc.umount2(target.encode(), MNT_DETACH), f"umount {target}")


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> None:
    _check(_libc.prctl(option, arg2, arg3, 0, 0), f"prctl {option}")


MADV_COLLAPSE = 25
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def collapse_to_huge_pages() -> int:
    """Ask the kernel to back this process's anonymous memory with 2 MiB pages now (Linux >= 6.1).

    Returns how many regions it collapsed. Best effort: older kernels simply say no.
    """
    done = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if fields[1].startswith("rw") and (len(fields) < 6 or fields[5] == "[heap]"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                lo, hi = (start + 0x1FFFFF) & ~0x1FFFFF, end & ~0x1FFFFF
                if hi > lo and _libc.madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
                    done += 1
    return done


_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine)
_libc.syscall.restype = ctypes.c_long


def pivot_root(new_root: str, put_old: str) -> None:
    """Make `new_root` the root of this mount namespace (glibc has no wrapper)."""
    if _SYS_PIVOT_ROOT is None:
        raise OSError(f"pivot_root: unknown syscall number on {os.uname().machine}")
    ret = _libc.syscall(
        _SYS_PIVOT_ROOT, ctypes.c_char_p(new_root.encode()), ctypes.c_char_p(put_old.encode())
    )
    _check(int(ret), "pivot_root")


_SYS_CAPSET = {"x86_64": 126, "aarch64": 91}.get(os.uname().machine)
_CAP_VERSION_3 = 0x20080522


def drop_capabilities() -> None:
    """Empty this process's effective, permitted and inheritable capability sets (capset(2)).

    A process that entered a user namespace holds every capability inside it; code that should
    run with none must drop them itself (ambient ones go with the permitted set).
    """
    if _SYS_CAPSET is None:
        raise OSError(f"capset: unknown syscall number on {os.uname().machine}")
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # two all-zero __user_cap_data_struct
    _check(int(_libc.syscall(_SYS_CAPSET, header, data)), "capset")


def sethostname(name: str) -> None:
    _check(_libc.sethostname(name.encode(), len(name)), "sethostname")


class SockFprog(ctypes.Structure):
    """struct sock_fprog: a compiled BPF program for PR_SET_SECCOMP."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def seccomp_fprog(program: bytes) -> SockFprog:
    """A compiled classic-BPF seccomp filter (8 bytes per instruction) as the kernel takes it."""
    buf = ctypes.create_string_buffer(program, len(program))
    prog = SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    prog.keep = buf  # the instructions must live as long as the struct pointing at them
    return prog


def load_seccomp(prog: SockFprog) -> None:
    """Install a filter made by seccomp_fprog in the calling process."""
    prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog))


# Holds the GIL across the call, so the child resumes exactly where the parent was.
_libc_gil = ctypes.PyDLL(None, use_errno=True)


def fork_bare() -> int:
    """fork(2) without Python's at-fork work; returns 0 in the child, its pid in the parent.

    os.fork runs the interpreter's after-fork hooks in every child (threading's re-init and
    random's reseed alone dirty ~160 copy-on-write pages, ~0.6 ms per call). They only matter
    for a parent with other threads; a single-threaded parent's child is already consistent. The
    child must reseed its random generators itself.
    """
    pid = _libc_gil.fork()
    if pid < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fork: {os.strerror(err)}")
    return pid
