"""`RayLearner` (tirl.rl.ray_learner), the driver's side: what each trainer worker is sent, and the
persistent weight-sync group the runtime's transport (tirl.runtime.handoff.RayGroup) keeps between
the learner's workers and the engines. The workers and engines here are actors that
keep what they were called with (their own side, the real TrainerWorker and vLLM engines, runs in
tests/runtime/test_ray.py's clusters, minutes a test): what crosses from the driver is the point.

- an update: each worker gets its own shard of the step's batch (put in the object store once per
  shard), not the whole batch by value to every worker (issue 41, item 5);
- a sync: the group of trainer rank 0 and the engines' ranks (a tensor-parallel engine brings each of
  its workers) is formed at the first sync and again only when the engines changed or one was revived,
  every member's end of the old one shut first."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from tests.rl.dist_worker import fixed_samples

from tirl.distributed.groups import DistInfo
from tirl.rl.config import AlgorithmConfig
from tirl.rl.update import Shard, shard_samples

ray = pytest.importorskip("ray")

from tirl.rl.ray_learner import RayLearner  # noqa: E402
from tirl.runtime.config import ClusterConfig  # noqa: E402
from tirl.runtime.handoff import InProcess, RayGroup, pick_transport  # noqa: E402
from tirl.runtime.ray_cluster import connect  # noqa: E402


class Member:
    """One end of the sync group (trainer rank 0 or an engine), keeping the calls it got, in order."""

    def __init__(self, n: int) -> None:
        self.n = n  # its node: 10.0.0.n
        self.reset(None)

    def niceness(self) -> int:
        return os.nice(0)

    def reset(self, reply: object, refuse: tuple[str, ...] = ()) -> None:
        """`refuse`: the calls ("join", "leave") that fail, as a member that cannot reach the group."""
        self.calls: list[tuple] = []
        self.reply, self.refuse = reply, refuse

    def _got(self, *call: object) -> object:
        self.calls.append(call)
        return self.reply

    def call(self, method: str, *args: object) -> object:
        return self._got(method, *args)

    def address(self) -> tuple[str, int]:
        return (f"10.0.0.{self.n}", 29555)

    def join_sync(self, group, rank: int = 0) -> None:
        self._got("join", group.host, group.port, group.world_size, group.backend, rank)
        if "join" in self.refuse:
            raise ConnectionError(f"member {self.n} could not reach {group.host}")

    def leave_sync(self) -> None:
        self._got("leave")
        if "leave" in self.refuse:
            raise ConnectionError(f"member {self.n} is gone")

    def send_weights(self, bucket_bytes: int, dtype: str | None) -> object:
        return self._got("send", bucket_bytes, dtype)

    def receive_sync(self) -> None:
        self._got("receive")

    def got(self) -> list[tuple]:
        return self.calls


class Fleet:
    """The runtime's engines as the sync sees them (tirl.runtime.ray.ActorFleet's two sync calls)."""

    def __init__(self, members: list) -> None:
        self.members, self.synced_with = members, []

    def sync_targets(self) -> list:
        return self.members

    def synced(self, members: list) -> None:
        self.synced_with.append([m.name for m in members])
        for m in members:
            m.revived = False


@pytest.fixture(scope="module")
def pool():
    """Recording actors, started once (each is a worker process: a second or two) and reset per use."""
    connect(ClusterConfig(backend="ray", namespace="tirl-test-ray-learner"))  # tirl's private Ray
    yield [ray.remote(num_cpus=0)(Member).remote(n) for n in range(4)]
    ray.shutdown()


def _take(pool: list, replies: list[object]) -> list:
    """len(replies) actors of the pool, their records cleared, each answering its reply."""
    ray.get([actor.reset.remote(r) for actor, r in zip(pool, replies, strict=False)])
    return pool[: len(replies)]


def _calls(actor) -> list[tuple]:
    return ray.get(actor.got.remote())


def _engine(actor, name: str, ranks: int = 1, dtype: str = "torch.bfloat16"):
    return SimpleNamespace(name=name, ranks=ranks, dtype=dtype, revived=False, up=True, actor=actor)


def test_the_private_rays_actors_run_at_their_drivers_niceness(pool):
    """Ray's default adds 15, which hands their CPU to any ordinary process on a shared machine; tirl's
    private Ray adds nothing (a driver started under `nice -n 19`, as `make mutate` runs, has actors at 19)."""
    assert ray.get([actor.niceness.remote() for actor in pool]) == [os.nice(0)] * len(pool)


def test_each_ray_worker_receives_only_its_own_shard(pool):
    world, alg = 3, AlgorithmConfig(mini_batches=2)
    samples = fixed_samples(vocab=50, n=11, seed=4)
    workers = _take(pool, [{"train/loss": float(rank)} for rank in range(world)])
    learner = RayLearner(workers, sends="full")
    assert learner.update(samples, alg) == {"train/loss": 0.0}  # rank 0's (all-reduced: all say the same)
    seen: list[list[int]] = []
    for rank, worker in enumerate(workers):
        [(method, shard, got_alg)] = _calls(worker)
        assert got_alg == alg
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


def test_the_sync_group_is_formed_once_and_again_only_when_its_engines_change(pool):
    stats = {"sync/tensors": 9.0, "sync/bytes": 123.0}
    *workers, a_actor, b_actor = _take(
        pool, [stats, {"sync/tensors": -1.0}, None, None]
    )  # rank 1's: not the step's
    a, b = (
        _engine(a_actor, "a", ranks=2),
        _engine(b_actor, "b"),
    )  # a: tensor parallel 2, two members of the group
    runtime = SimpleNamespace(fleet=Fleet([a, b]))
    group = RayGroup(runtime.fleet, workers, bucket_bytes=2**20, backend="nccl")

    first = group.send()
    assert first == stats | {"sync/engines": 2.0, "sync/group_formed": 1.0}
    joined = ("join", "10.0.0.0", 29555, 4, "nccl")  # rank 0 + a's 2 + b's 1, where rank 0 listens
    assert _calls(workers[0]) == [(*joined, 0), ("send", 2**20, "torch.bfloat16")]
    assert _calls(workers[1]) == [("send", 2**20, "torch.bfloat16")]  # its gathers, no group of its own
    assert _calls(a.actor) == [(*joined, 1), ("receive",)] and _calls(b.actor) == [(*joined, 3), ("receive",)]
    assert runtime.fleet.synced_with == [["a", "b"]]

    assert group.send()["sync/group_formed"] == 0.0  # the same engines: the same group
    assert _calls(b.actor)[2:] == [("receive",)]

    b.revived = True  # a new process: it knows no group, so it is formed again
    assert group.send()["sync/group_formed"] == 1.0
    assert _calls(workers[0])[3:] == [("leave",), (*joined, 0), ("send", 2**20, "torch.bfloat16")]
    assert [c[0] for c in _calls(a.actor)[3:]] == ["leave", "join", "receive"]
    assert runtime.fleet.synced_with[-1] == ["a", "b"] and not b.revived

    b.up = False  # b died: the others leave the old group, b took its end along; a forms one alone
    runtime.fleet.members = [a]
    assert group.send() == stats | {"sync/engines": 1.0, "sync/group_formed": 1.0}
    assert _calls(workers[0])[-2][:4] == ("join", "10.0.0.0", 29555, 3)  # rank 0 + a's 2
    assert [c[0] for c in _calls(b.actor)] == ["join", "receive", "receive", "leave", "join", "receive"]

    group.close()
    assert _calls(workers[0])[-1] == ("leave",) and _calls(a.actor)[-1] == ("receive",)
    ray.get(workers[0].reset.remote(stats))
    group.send()  # after the close a sync forms a group, with nothing left to shut
    assert [c[0] for c in _calls(workers[0])] == ["join", "send"]


@pytest.mark.parametrize("who", ["trainer rank 0", "an engine"])
def test_a_member_that_cannot_join_fails_the_sync_and_the_next_one_forms_the_group_again(pool, who):
    stats = {"sync/tensors": 1.0}
    worker, engine_actor = _take(pool, [stats, None])
    refusing, reply = (worker, stats) if who == "trainer rank 0" else (engine_actor, None)
    a = _engine(engine_actor, "a")
    runtime = SimpleNamespace(fleet=Fleet([a]))
    group = RayGroup(runtime.fleet, [worker], bucket_bytes=2**20, backend="gloo")
    group.send()
    a.revived = True  # the group is formed again...
    ray.get(refusing.reset.remote(reply, ("join",)))  # ...and one member cannot join it
    with pytest.raises(ConnectionError, match=r"could not reach 10\.0\.0\.0"):
        group.send()
    assert runtime.fleet.synced_with == [["a"]]  # nothing was sent the second time
    ray.get([worker.reset.remote(stats), engine_actor.reset.remote(None)])
    assert group.send()["sync/group_formed"] == 1.0
    # the old group was shut before the failed try: nobody is asked to leave it twice
    assert [c[0] for c in _calls(worker)] == ["join", "send"]
    assert [c[0] for c in _calls(engine_actor)] == ["join", "receive"]


def test_an_end_that_cannot_be_shut_stops_neither_a_new_group_nor_the_close(pool):
    stats = {"sync/tensors": 1.0}
    worker, engine_actor = _take(pool, [stats, None])
    a = _engine(engine_actor, "a")
    runtime = SimpleNamespace(fleet=Fleet([a]))
    group = RayGroup(runtime.fleet, [worker], bucket_bytes=2**20, backend="gloo")
    group.send()
    a.revived = True
    ray.get([worker.reset.remote(stats, ("leave",)), engine_actor.reset.remote(None, ("leave",))])
    assert group.send()["sync/group_formed"] == 1.0  # the failed leaves are passed over
    assert [c[0] for c in _calls(worker)] == ["leave", "join", "send"]
    group.close()  # rank 0's end is gone too: the run still ends cleanly
    assert _calls(worker)[-1] == ("leave",)


def test_the_runtime_picks_the_transport_once_and_no_engine_up_still_sends_alone(pool):
    """The ray runtime's fleet: its group, NCCL on GPUs unless colocated (NCCL refuses two members on one
    GPU), the cluster's bucket size; the local runtime (or no engines): in this process."""
    [worker] = _take(pool, [None])
    learner = RayLearner([worker], sends="lora")
    ray_runtime, info = SimpleNamespace(fleet=Fleet([])), DistInfo(0, 1, torch.device("cpu"))
    cluster = ClusterConfig(backend="ray", weight_sync_bucket_mb=2, trainer={"num_gpus": 1})
    group = pick_transport(ray_runtime, learner, info, cluster)
    assert isinstance(group, RayGroup) and (group.backend, group.bucket_bytes) == ("nccl", 2 * 2**20)
    colocated = cluster.model_copy(update={"colocate": True})
    assert pick_transport(ray_runtime, learner, info, colocated).backend == "gloo"
    assert isinstance(pick_transport(None, learner, info, cluster), InProcess)
    assert isinstance(pick_transport(SimpleNamespace(fleet=None), learner, info, ClusterConfig()), InProcess)
    assert _calls(worker) == [] and learner.sends == "lora"
    # no engine up to receive (every one died, none came back): rank 0 alone, in no dtype of theirs
    ray.get(worker.reset.remote({"sync/tensors": 2.0}))
    group = RayGroup(Fleet([]), [worker], bucket_bytes=2**20, backend="gloo")
    assert group.send() == {"sync/tensors": 2.0, "sync/engines": 0.0, "sync/group_formed": 1.0}
    assert _calls(worker) == [("join", "10.0.0.0", 29555, 1, "gloo", 0), ("send", 2**20, None)]


def test_every_rank_takes_every_call_with_its_arguments(pool):
    workers = _take(pool, [False, True])
    learner = RayLearner(workers, sends="full")
    assert learner.offload("params") is True and learner.onload() is True  # any rank that moved says so
    assert learner.offload() is True
    learner.reset_optimizer(7)
    learner.snapshot_reference()
    learner.restore({"step": 3})
    learner.stage_checkpoint("run", 3)
    learner.publish_checkpoint("run", 3, "tok", {"step": 3}, 2)
    want = [
        ("offload", "params"),
        ("onload",),
        ("offload", "all"),
        ("reset_optimizer", 7),
        ("snapshot_reference",),
        ("restore", {"step": 3}),
        ("stage_checkpoint", "run", 3),
        ("publish_checkpoint", "run", 3, "tok", {"step": 3}, 2),
    ]
    assert [_calls(w) for w in workers] == [want, want]
    quiet = RayLearner(_take(pool, [False, False]), sends="full")
    assert quiet.offload() is False and quiet.onload() is False  # no rank held GPU memory
