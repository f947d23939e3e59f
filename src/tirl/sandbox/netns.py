"""The one shared, empty network namespace every slot joins (no interfaces up: no network at all).

Joining one namespace is cheaper than creating one per call and leaves nothing to clean up:
a short-lived helper creates it, we keep a file descriptor, the namespace lives as long as it.
"""

from __future__ import annotations

import os
import subprocess
import sys

_HELPER = (
    "import sys\nfrom tirl import linux\nlinux.unshare(linux.CLONE_NEWNET)\n"
    "print('ready', flush=True)\nsys.stdin.read()\n"
)


def create_empty_netns(env: dict[str, str]) -> int:
    """A file descriptor of a fresh network namespace; needs CAP_SYS_ADMIN (root)."""
    helper = subprocess.Popen(
        [sys.executable, "-c", _HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    try:
        line = helper.stdout.readline()
        if line.strip() != b"ready":
            raise OSError("could not create a network namespace")
        return os.open(f"/proc/{helper.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        helper.stdin.close()
        helper.stdout.close()
        helper.wait(timeout=10)
