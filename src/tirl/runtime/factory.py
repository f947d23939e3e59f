"""Open a runtime (and, on Ray, the cluster placement it shares with the trainer workers) from the
config: the one place that picks the backend (`cluster.backend: local | ray`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tirl.engines.config import EngineConfig
    from tirl.reward import RewardConfig
    from tirl.runtime.base import Runtime
    from tirl.runtime.config import ClusterConfig
    from tirl.runtime.ray_cluster import Placement
    from tirl.sandbox import SandboxConfig


@contextmanager
def open_cluster_placement(cluster: ClusterConfig, num_engines: int) -> Iterator[Placement | None]:
    """backend=ray: the bundles of the engine actors and trainer workers, reserved together
    (cluster.colocate: shared; tirl.runtime.ray_cluster). backend=local places nothing."""
    if cluster.backend != "ray":
        yield None
        return
    from tirl.runtime.ray_cluster import open_placement

    with open_placement(cluster, num_engines, cluster.trainer.ranks) as placement:
        yield placement


@asynccontextmanager
async def open_runtime(
    cluster: ClusterConfig,
    engine: EngineConfig,
    sandbox: SandboxConfig,
    reward: RewardConfig | None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    placement: Placement | None = None,
) -> AsyncIterator[Runtime]:
    """Engines serving `engine.model`, a sandbox, reward workers (none if `reward` is None); all
    closed on exit, whatever happened. `placement` (backend=ray): the engine slots reserved with the
    trainer's (tirl.runtime.ray_cluster.open_placement; cluster.colocate)."""
    if cluster.backend == "ray":
        from tirl.runtime.ray import open_ray_runtime

        async with open_ray_runtime(cluster, engine, sandbox, reward, tokenizer, placement) as rt:
            yield rt
    else:
        from tirl.runtime.local import open_local_runtime

        async with open_local_runtime(cluster, engine, sandbox, reward, tokenizer) as rt:
            yield rt
