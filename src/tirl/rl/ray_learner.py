"""The trainer side on Ray: one TrainerWorker actor per training rank (cluster.trainer.ranks), all in
one torch.distributed group (FSDP2; gloo on CPU, NCCL on GPU), driven through the Learner interface
by the driver's rl_step, and the bucketed weight sync from rank 0 to the engine actors.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tirl.distributed.weight_sync import SyncGroup, free_port, send_weights
from tirl.runtime.base import Runtime
from tirl.runtime.ray import RemoteEngine
from tirl.runtime.ray_cluster import ClusterError, Placement, connect, node_ip, whereabouts

if TYPE_CHECKING:
    from tirl.rl.config import AlgorithmConfig, TrainConfig
    from tirl.rl.policy import TrainSample


class TrainerWorker:
    """One training rank: a LocalLearner in a torch.distributed group with the other workers."""

    def describe(self) -> dict[str, Any]:
        return whereabouts()

    def address(self) -> tuple[str, int]:
        return node_ip(), free_port()

    def setup(
        self, rank: int, world: int, master: tuple[str, int], model_path: str, optim, total_steps: int
    ) -> None:
        from tirl.distributed.groups import init_distributed
        from tirl.rl.local_learner import LocalLearner
        from tirl.rl.policy import Policy

        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR=master[0], MASTER_PORT=str(master[1]),
        )  # fmt: skip
        info = init_distributed(optim.device)
        self.learner = LocalLearner(Policy(model_path, optim, info, total_steps))

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.learner, method)(*args)

    def send_weights(self, group: SyncGroup | None, bucket_bytes: int) -> dict[str, float]:
        device = (
            self.learner.policy.device
            if group is not None and group.backend == "nccl"
            else torch.device("cpu")
        )
        pg = group.join(0) if group is not None else None
        return send_weights(self.learner.policy.model, pg, bucket_bytes, device)


class RayLearner:
    """The Learner interface on one TrainerWorker per rank; every call goes to all ranks at once."""

    def __init__(self, workers: list, bucket_bytes: int, backend: str):
        self.workers, self.bucket_bytes, self.backend = workers, bucket_bytes, backend

    def _all(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([w.call.remote(method, *args) for w in self.workers])

    def update(self, samples: list[TrainSample], alg: AlgorithmConfig) -> dict[str, Any]:
        return self._all("update", samples, alg)[0]  # the metrics are all-reduced: rank 0's say it all

    def sync_weights(self, runtime: Runtime | None) -> dict[str, float]:
        import ray

        if runtime is None:
            return {}
        engines = [e for e in runtime.engines if isinstance(e, RemoteEngine)]
        if len(engines) != len(runtime.engines):
            raise ClusterError("backend=ray trains on Ray workers and needs engines from the ray runtime")
        fleet = engines[0].fleet
        host, port = ray.get(self.workers[0].address.remote())  # on trainer rank 0's node
        members = fleet.sync_targets()
        group = SyncGroup(host, port, 1 + len(members), self.backend)
        sends = [
            w.send_weights.remote(group if r == 0 else None, self.bucket_bytes)
            for r, w in enumerate(self.workers)
        ]
        receives = [e.actor.receive_weights.remote(group, i + 1) for i, e in enumerate(members)]
        stats = ray.get(sends)[0]
        ray.get(receives)
        fleet.synced(members)
        return stats | {"sync/engines": float(len(members))}

    def reset_optimizer(self, total_steps: int) -> None:
        self._all("reset_optimizer", total_steps)

    def snapshot_reference(self) -> None:
        self._all("snapshot_reference")

    def restore(self, saved: dict) -> None:
        self._all("restore", saved)

    def save(self, run_dir: Path, step: int, tokenizer, state: dict, keep_last: int) -> None:
        self._all("save", run_dir, step, tokenizer, state, keep_last)


@asynccontextmanager
async def open_ray_learner(
    cfg: TrainConfig, model_path: str, total_steps: int, placement: Placement
) -> AsyncIterator[RayLearner]:
    """cluster.trainer.ranks TrainerWorker actors in `placement`'s trainer slots, one FSDP2 group."""
    ray = connect(cfg.cluster)
    ranks = len(placement.trainer)
    actor_cls = ray.remote(TrainerWorker)
    workers = [actor_cls.options(**slot.options()).remote() for slot in placement.trainer]
    try:
        master = await workers[0].address.remote()
        await asyncio.gather(
            *(
                w.setup.remote(r, ranks, master, model_path, cfg.optim, total_steps)
                for r, w in enumerate(workers)
            )
        )
        # NCCL refuses a group with two members on one GPU, which colocated rank 0 and engine 0 are:
        # colocated, the sync is staged through host memory over gloo (CUDA IPC would be the fast path).
        backend = "nccl" if cfg.cluster.trainer.num_gpus > 0 and not cfg.cluster.colocate else "gloo"
        yield RayLearner(workers, int(cfg.cluster.weight_sync_bucket_mb * 2**20), backend)
    finally:
        for w in workers:
            ray.kill(w)


__all__ = ["RayLearner", "TrainerWorker", "open_ray_learner"]
