"""What each Ray trainer worker is sent for an update: its own shard of the step's batch (put in the
object store once per shard), not the whole batch by value to every worker (issue 41, item 5)."""

from __future__ import annotations

import pytest
import torch
from tests.rl.dist_worker import fixed_samples

from tirl.distributed.groups import DistInfo
from tirl.rl.config import AlgorithmConfig
from tirl.rl.update import Shard, shard_samples

ray = pytest.importorskip("ray")

from tirl.rl.ray_learner import RayLearner  # noqa: E402


class Received:
    """A trainer worker's `call` seam that keeps what it was sent (the worker's learner is beside the
    point here: what crosses from the driver is)."""

    def __init__(self) -> None:
        self.got: list[tuple[str, object]] = []

    def call(self, method: str, *args: object) -> dict[str, float]:
        self.got.append((method, args[0]))
        return {"train/loss": 0.0}

    def received(self) -> list[tuple[str, object]]:
        return self.got


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=1, include_dashboard=False, namespace="tirl-test-shards", log_to_driver=False)
    yield
    ray.shutdown()


def test_each_ray_worker_receives_only_its_own_shard(local_ray):
    world, alg = 3, AlgorithmConfig(mini_batches=2)
    samples = fixed_samples(vocab=50, n=11, seed=4)
    workers = [ray.remote(num_cpus=0)(Received).remote() for _ in range(world)]
    learner = RayLearner(workers, bucket_bytes=2**20, backend="gloo", sends="full")
    learner.update(samples, alg)
    seen: list[list[int]] = []
    for rank, worker in enumerate(workers):
        [(method, shard)] = ray.get(worker.received.remote())
        assert method == "update" and isinstance(shard, Shard), type(shard)
        # exactly what grpo_update on this rank trains from the whole batch, mini-batch by mini-batch
        info = DistInfo(rank, world, torch.device("cpu"))
        want = [shard_samples(samples[m::2], info) for m in range(2)]
        assert [[s.input_ids for s in mini] for mini in shard.minis] == [
            [s.input_ids for s in mini] for mini in want
        ]
        assert shard.sequences == len(samples)
        seen += [s.input_ids for mini in shard.minis for s in mini]
    # together the shards are the batch, each sample sent to one worker only
    assert sorted(seen) == sorted(s.input_ids for s in samples) and len(seen) == len(samples)
