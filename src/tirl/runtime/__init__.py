"""tirl.runtime: where engines, sandboxes and reward workers run (`cluster.backend: local | ray`)."""

from tirl.runtime.base import Runtime, Scorer, generate, generate_scored, score_trajectory
from tirl.runtime.config import ClusterConfig
from tirl.runtime.factory import open_cluster_placement, open_runtime

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
