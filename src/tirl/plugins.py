"""Named choices users extend: a built-in name from a registry, or `package.module:attribute`.

Tools (tirl.agent.tools), policy losses and advantage estimators (tirl.rl.losses,
tirl.rl.advantages) are all chosen this way in configs, and an unknown name lists the known ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


class PluginError(ValueError):
    """A configured name is neither built in nor an importable `module:attribute`."""


def resolve(kind: str, registry: Mapping[str, T], spec: str) -> T:
    """`registry[spec]`, or the object a `module:attribute` path names (not checked further here)."""
    if spec in registry:
        return registry[spec]
    if ":" not in spec:
        raise PluginError(
            f"unknown {kind} {spec!r}: use one of {', '.join(registry)} or a path like mypkg.module:name"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(
            f"{kind} {spec!r}: cannot import module {module_name!r} ({exc}); is it installed or on PYTHONPATH?"
        ) from exc
    if not hasattr(module, attr):
        raise PluginError(f"{kind} {spec!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)
