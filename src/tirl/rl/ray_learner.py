"""The trainer side on Ray: one TrainerWorker actor per training rank (cluster.trainer.ranks), all in
one torch.distributed group (FSDP2; gloo on CPU, NCCL on GPU), driven through the Learner interface
by the driver's rl_step. Each worker holds its end of a weight sync (rank 0 its end of the sync group,
every rank its gathers); the group is formed and left by the runtime's transport
(tirl.runtime.handoff.RayGroup), which drives `workers`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tirl.distributed.groups import DistInfo, fails_in_minutes
from tirl.distributed.weight_sync import SyncChannel, SyncGroup, SyncKind, send_weights
from tirl.ports import free_port
from tirl.rl.update import Shard, shard_update
from tirl.runtime.ray_cluster import Placement, connect, node_ip, whereabouts

if TYPE_CHECKING:
    from tirl.rl.config import AlgorithmConfig, TrainConfig
    from tirl.rl.policy import TrainSample


class TrainerWorker:
    """One training rank: a LocalLearner in a torch.distributed group with the other workers."""

    def describe(self) -> dict[str, Any]:
        return whereabouts()

    def address(self) -> tuple[str, int]:
        return node_ip(), free_port("")

    def setup(
        self, rank: int, world: int, master: tuple[str, int], model_path: str, optim, total_steps: int
    ) -> None:
        from tirl.distributed.groups import init_distributed
        from tirl.rl.local_learner import LocalLearner
        from tirl.rl.policy import Policy

        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
        )
        info = init_distributed(optim.device)
        self.learner = LocalLearner(Policy(model_path, optim, info, total_steps))

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.learner, method)(*args)

    def join_sync(self, group: SyncGroup) -> None:
        """Rank 0: the source end of the persistent sync group."""
        self.leave_sync()
        self.channel = SyncChannel(group, 0, node_ip())  # gloo listens there, not where the hostname says

    def leave_sync(self) -> None:
        channel = getattr(self, "channel", None)
        if channel is not None:
            channel.close()
            self.channel = None

    def sends(self) -> str:
        return self.learner.sends

    def send_weights(self, bucket_bytes: int, dtype: str | None) -> dict[str, float]:
        """Every rank (the FSDP gathers are collectives); rank 0 sends through its channel. What
        travels is the learner's to say (every weight, or LoRA's merged layers: LocalLearner.sync_tensors)."""
        channel = getattr(self, "channel", None)
        pg = channel.pg if channel is not None else None
        on_gpu = channel is not None and channel.group.backend == "nccl"
        device = self.learner.policy.device if on_gpu else torch.device("cpu")
        wire = getattr(torch, dtype.removeprefix("torch.")) if dtype else None
        tensors = self.learner.sync_tensors()
        with fails_in_minutes("the weight sync", self.learner.info):
            return send_weights(self.learner.policy.model, pg, bucket_bytes, device, wire, tensors=tensors)


class RayLearner:
    """The Learner interface on one TrainerWorker per rank; every call goes to all ranks at once."""

    def __init__(self, workers: list, sends: SyncKind):
        self.workers = workers  # what a sync's transport drives (tirl.runtime.handoff.RayGroup)
        self.sends = sends  # what every sync carries, as the workers' learners decided it

    def _all(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([w.call.remote(method, *args) for w in self.workers])

    def update(self, samples: list[TrainSample], alg: AlgorithmConfig) -> dict[str, Any]:
        """Each worker gets its own shard only (put in the object store once, fetched by that worker),
        not the whole step's batch pickled once per worker."""
        import ray

        shards = [ray.put(s) for s in worker_shards(samples, alg, len(self.workers))]
        calls = [w.call.remote("update", shard, alg) for w, shard in zip(self.workers, shards, strict=True)]
        return ray.get(calls)[0]  # the metrics are all-reduced: rank 0's say it all

    def offload(self, what: str = "all") -> bool:
        return any(self._all("offload", what))

    def onload(self) -> bool:
        return any(self._all("onload"))

    def reset_optimizer(self, total_steps: int) -> None:
        self._all("reset_optimizer", total_steps)

    def snapshot_reference(self) -> None:
        self._all("snapshot_reference")

    def restore(self, saved: dict) -> None:
        self._all("restore", saved)

    def stage_checkpoint(self, run_dir: Path, step: int) -> None:
        self._all("stage_checkpoint", run_dir, step)

    def publish_checkpoint(self, run_dir: Path, step: int, tokenizer, state: dict, keep_last: int) -> None:
        self._all("publish_checkpoint", run_dir, step, tokenizer, state, keep_last)


def worker_shards(samples: list[TrainSample], alg: AlgorithmConfig, world: int) -> list[Shard]:
    """Rank r's share of the step's batch, for r in 0..world-1: what `grpo_update` on rank r would
    take from the whole batch (tirl.rl.update.shard_update)."""
    return [shard_update(samples, alg, DistInfo(r, world, torch.device("cpu"))) for r in range(world)]


@asynccontextmanager
async def open_ray_learner(
    cfg: TrainConfig, model_path: str, total_steps: int, placement: Placement
) -> AsyncIterator[RayLearner]:
    """cluster.trainer.ranks TrainerWorker actors in `placement`'s trainer slots, one FSDP2 group (the
    runtime's handoff offloads them before the engines start, when colocated)."""
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
        yield RayLearner(workers, await workers[0].sends.remote())
    finally:
        for w in workers:
            ray.kill(w)


__all__ = ["RayLearner", "TrainerWorker", "open_ray_learner", "worker_shards"]
