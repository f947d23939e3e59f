"""A free TCP port: the one place tirl asks the kernel for a port nothing listens on."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on now, the kernel's pick ("" binds every interface, for
    a rendezvous other nodes reach). Another process may take it before the caller binds it: callers
    that can bind port 0 themselves should."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
