"""The seccomp denylist: syscalls user code never needs and an escape would (docs/sandbox.md).

The filter is compiled once per zygote to classic BPF (and wrapped for the kernel once per fork
server) and installed per call with one prctl: no libseccomp compile, no ctypes objects per call.
"""

from __future__ import annotations

import errno
import os
import socket

from tirl import linux

DENIED_SYSCALLS = (
    # debugging / reading other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp",
    # namespaces and the filesystem tree
    "mount", "umount2", "unshare", "setns", "pivot_root", "chroot", "open_by_handle_at",
    "name_to_handle_at", "fsopen", "fsmount", "fsconfig", "fspick", "move_mount", "open_tree",
    "mount_setattr",
    # kernel attack surface
    "bpf", "keyctl", "add_key", "request_key", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "fanotify_init", "lookup_dcookie",
    # the machine itself
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "acct", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "syslog", "quotactl", "vhangup", "personality",
    # pinned to a CPU other processes keep busy, a spinning call's own time-out would read as
    # starvation (an infrastructure status); the scheduler places the call's threads
    "sched_setaffinity",
)  # fmt: skip
ALLOWED_FAMILIES = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)
TIOCSTI = 0x5412  # push characters into a terminal's input queue
NAMESPACE_CLONE_FLAGS = (
    linux.CLONE_NEWNS, linux.CLONE_NEWUTS, linux.CLONE_NEWIPC, linux.CLONE_NEWUSER,
    linux.CLONE_NEWPID, linux.CLONE_NEWNET, 0x02000000,  # CLONE_NEWCGROUP
)  # fmt: skip


def compile_denylist() -> bytes:
    """The denylist as BPF bytes: denied calls fail with EPERM, everything else is allowed."""
    import pyseccomp as sc

    f = sc.SyscallFilter(sc.ALLOW)
    deny = sc.ERRNO(errno.EPERM)
    for name in DENIED_SYSCALLS:
        f.add_rule(deny, name)
    f.add_rule(deny, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, TIOCSTI))
    for flag in NAMESPACE_CLONE_FLAGS:  # clone() may fork and spawn threads, not make namespaces
        f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    # Socket families: local, IPv4 and IPv6 only (the latter fail cleanly without a network). No
    # AF_VSOCK to the hypervisor, no netlink, packet or bluetooth sockets.
    no_family = sc.ERRNO(errno.EAFNOSUPPORT)
    for call in ("socket", "socketpair"):
        f.add_rule(no_family, call, sc.Arg(0, sc.GT, max(ALLOWED_FAMILIES)))
        for family in set(range(max(ALLOWED_FAMILIES))) - set(ALLOWED_FAMILIES):
            f.add_rule(no_family, call, sc.Arg(0, sc.EQ, family))
    # clone3 passes its flags in memory BPF cannot read: ENOSYS makes libc fall back to clone().
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    f.set_attr(sc.Attr.CTL_NNP, 0)  # no_new_privs is set explicitly by the caller
    with os.fdopen(os.memfd_create("seccomp-bpf"), "w+b") as tmp:  # the filesystem is read-only here
        f.export_bpf(tmp)
        tmp.seek(0)
        return tmp.read()


def install(program: linux.SockFprog) -> None:
    """Install the denylist, made once per slot by linux.seccomp_fprog, in the calling process
    (irreversible; inherited by children)."""
    linux.load_seccomp(program)


def available() -> str | None:
    """None if the filter can be built here, else why not (e.g. libseccomp is not installed)."""
    try:
        compile_denylist()
    except (ImportError, OSError, RuntimeError) as exc:
        return f"seccomp filter unavailable ({exc}): install libseccomp2"
    return None
