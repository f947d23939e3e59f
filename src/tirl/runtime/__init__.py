"""tirl.runtime: where engines, sandboxes and reward workers run (`cluster.backend: local | ray`).

Names are imported lazily: a Ray actor of a torch-free module here (tirl.runtime.ray_services) imports
this package first, and tirl.runtime.base imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "Runtime": "base", "Scorer": "base", "generate": "base", "generate_scored": "base",
    "score_trajectory": "base", "ClusterConfig": "config", "open_cluster_placement": "factory",
    "open_runtime": "factory",
}  # fmt: skip
__all__ = [
    "ClusterConfig",
    "Runtime",
    "Scorer",
    "generate",
    "generate_scored",
    "open_cluster_placement",
    "open_runtime",
    "score_trajectory",
]

if TYPE_CHECKING:
    from tirl.runtime.base import Runtime, Scorer, generate, generate_scored, score_trajectory
    from tirl.runtime.config import ClusterConfig
    from tirl.runtime.factory import open_cluster_placement, open_runtime


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tirl.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tirl.runtime.{_EXPORTS[name]}"), name)
