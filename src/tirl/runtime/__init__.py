"""tirl.runtime: where engines, sandboxes and reward workers run (`cluster.backend: local | ray`)."""

from tirl.runtime.base import Runtime, Scorer, generate, generate_scored, open_runtime, score
from tirl.runtime.config import ClusterConfig

__all__ = ["ClusterConfig", "Runtime", "Scorer", "generate", "generate_scored", "open_runtime", "score"]
