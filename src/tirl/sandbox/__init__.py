"""tirl.sandbox: the isolated Python execution service (warm zygotes, fork per call, Linux isolation).

Sandbox (in-process pool), SandboxClient (HTTP), SandboxConfig + open_executor (get one either way).
Names are imported lazily so the zygotes (which import this package) stay small and fork fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "ExecResult": "result", "Executor": "result", "Status": "result", "Limits": "limits", "Sandbox": "pool",
    "SandboxClient": "client", "SandboxConfig": "service", "open_executor": "service",
}  # fmt: skip
__all__ = [
    "ExecResult",
    "Executor",
    "Limits",
    "Sandbox",
    "SandboxClient",
    "SandboxConfig",
    "Status",
    "open_executor",
]

if TYPE_CHECKING:
    from tirl.sandbox.client import SandboxClient
    from tirl.sandbox.limits import Limits
    from tirl.sandbox.pool import Sandbox
    from tirl.sandbox.result import ExecResult, Executor, Status
    from tirl.sandbox.service import SandboxConfig, open_executor


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tirl.sandbox' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tirl.sandbox.{_EXPORTS[name]}"), name)
