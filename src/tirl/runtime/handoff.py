"""The handoff: one per rank, the owner of what passes between the trainer and the engines: the devices
(colocated, engines and trainer ranks take turns on the same GPUs) and the weights (each sync, by the
one transport picked when the runtime opens). The learner only offers what it has: its state's moves
(`offload`, `onload`), what a sync carries (`sends`, `sync_tensors`) or, on Ray, its rank workers.

Engine i shares trainer rank i's GPU (torchrun: engine i on cuda:i next to rank i; Ray: one bundle).
Around each update the engines lend their memory to the trainer and get it back for the sync:

    engines sleep, all at once              (weights discarded when a full sync rewrites them; kept
                                             when the learner sends only the LoRA-adapted layers)
    -- gate --                              (no rank takes memory its engine still holds)
    trainer parameters + optimizer state on the device; the update (and a due checkpoint's shards)
    optimizer state off the device          (every rank)
    -- barrier --                           (no engine wakes into memory its rank still holds)
    engines wake their weights; the sync writes into them
    trainer parameters off the device
    -- barrier --
    engines wake their KV cache

At the start of a run every rank's state leaves its devices before the runtime opens the engines
(`open_handoff`, both backends), so they size their KV cache with the trainer's memory free; it comes
back at the first update. Engines that freed nothing when asked to sleep (no sleep mode, a CPU) lend
nothing: the trainer's state then stays on its devices. A checkpoint is written right after the
update (tirl.rl.trainer.rl_step), where the state already is on its devices and the engines asleep; the
KL reference's snapshot and a resume's restore borrow the devices the same way as an update, engines
keeping their weights (no sync follows). Only rank 0 holds the engines (`engines` is None elsewhere);
every rank moves its own trainer state, and the barriers make the others wait for it. On Ray one driver
call moves every rank at once (the call returns when all did), so its barrier is the call itself.

The transports (`pick_transport`, once):
  InProcess  the local runtime (torchrun, or one process): every rank gathers each tensor (a collective
             under FSDP) and rank 0 packs them once for its engines (Runtime.load_sources: one flat
             buffer in their dtype, on the GPU for an engine there; tirl.engines.handoff).
  RayGroup   the ray runtime: buckets over one process group of trainer rank 0 and the engines'
             workers (tirl.distributed.weight_sync), formed at the first sync and again only when the
             engines change (a revived one is a new process), shut down when the runtime closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tirl.distributed.groups import barrier, broadcast_object, fails_in_minutes
from tirl.distributed.weight_sync import FULL_SYNC, Source, SyncGroup, SyncKind, gathered

if TYPE_CHECKING:
    from tirl.distributed.groups import DistInfo
    from tirl.engines.versions import WeightVersions
    from tirl.runtime.base import Runtime, SyncFleet
    from tirl.runtime.config import ClusterConfig


def _takes_turns(cluster: ClusterConfig, async_: bool) -> bool:
    """Whether engines and trainer ranks take turns on the same devices around each update: they share
    them (cluster.colocated) and are synchronous (async engines keep generating meanwhile)."""
    return cluster.colocated and not async_


class Trainer(Protocol):
    """The trainer side (tirl.rl.learner.Learner): where its state lives and what its sync carries."""

    sends: SyncKind

    def offload(self, what: str = "all") -> bool: ...

    def onload(self) -> bool: ...


class LocalTrainer(Trainer, Protocol):
    """A trainer in this process (tirl.rl.local_learner.LocalLearner): the tensors a sync carries, each
    made when its turn comes (an FSDP gather), and the device they are on."""

    device: torch.device

    def sync_tensors(self) -> dict[str, Source]: ...


class RankWorkers(Trainer, Protocol):
    """A trainer of Ray actors, one per rank (tirl.rl.ray_learner.TrainerWorker): `address()` where
    rank 0 listens, `join_sync(group)` / `leave_sync()` rank 0's end of the group, `send_weights(bucket
    bytes, dtype)` every rank's part of a sync."""

    workers: list[Any]


class Transport(Protocol):
    def send(self) -> dict[str, float]: ...

    def close(self) -> None: ...


class InProcess:
    """Every rank's trainer in this process; rank 0's engines (None elsewhere) load from it."""

    def __init__(self, engines: Runtime | None, trainer: LocalTrainer, info: DistInfo) -> None:
        self.engines, self.trainer, self.info = engines, trainer, info

    def send(self) -> dict[str, float]:
        sources = self.trainer.sync_tensors()
        with fails_in_minutes("the weight sync's gathers", self.info):
            if self.engines is not None:
                return self.engines.load_sources(sources, self.trainer.device)
            for source in sources.values():  # this rank's part of rank 0's gathers, in the same order
                gathered(source)
        return {"sync/tensors": 0.0, "sync/bytes": 0.0}

    def close(self) -> None:
        pass


class RayGroup:
    """The sync group of trainer rank 0 and the fleet's engine workers: formed at the first sync, again
    only when the engines changed, left at `close`; every rank worker sends (its gathers are collectives)."""

    def __init__(self, fleet: SyncFleet, workers: list[Any], bucket_bytes: int, backend: str) -> None:
        self.fleet, self.workers, self.bucket_bytes, self.backend = fleet, workers, bucket_bytes, backend
        self._members: list[str] | None = None  # the engines in the current group

    def send(self) -> dict[str, float]:
        import ray

        members = self.fleet.sync_targets()
        formed = self._ensure_group(members)
        dtype = members[0].dtype if members else None
        sends = [w.send_weights.remote(self.bucket_bytes, dtype) for w in self.workers]
        receives = [e.actor.receive_sync.remote() for e in members]
        stats = ray.get(sends)[0]
        ray.get(receives)
        self.fleet.synced(members)
        return stats | {"sync/engines": float(len(members)), "sync/group_formed": float(formed)}

    def _ensure_group(self, members: list[Any]) -> bool:
        """The group of trainer rank 0 and `members`, formed again only when they changed (a revived
        engine is a new process); True when formed now."""
        import ray

        key = [e.name for e in members]
        if key == self._members and not any(e.revived for e in members):
            return False
        self._leave(members)
        host, port = ray.get(self.workers[0].address.remote())  # on trainer rank 0's node
        group = SyncGroup(host, port, 1 + sum(e.ranks for e in members), self.backend)
        ranks = itertools.accumulate((e.ranks for e in members), initial=1)
        joins = [self.workers[0].join_sync.remote(group)]
        joins += [e.actor.join_sync.remote(group, r) for e, r in zip(members, ranks, strict=False)]
        ray.get(joins)  # all at once: the group's rendezvous waits for every member
        self._members = key
        return True

    def _leave(self, members: list[Any]) -> None:
        """Every member's end of the old group shut down (engines that died took theirs along)."""
        import ray

        if self._members is None:
            return
        calls = [self.workers[0].leave_sync.remote()] + [e.actor.leave_sync.remote() for e in members if e.up]
        for call in calls:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(call)
        self._members = None

    def close(self) -> None:
        """Trainer rank 0's end of the group (the engines shut theirs as they close)."""
        import ray

        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(self.workers[0].leave_sync.remote())
        self._members = None


def pick_transport(
    engines: Runtime | None, trainer: Trainer, info: DistInfo, cluster: ClusterConfig
) -> Transport:
    """The one place a sync's way to the engines is chosen: a group beside the ray runtime's actor fleet
    (NCCL inside the workers; gloo where an engine shares rank 0's GPU, which NCCL refuses, or on CPU),
    else in this process."""
    if engines is not None and engines.fleet is not None:
        backend = "nccl" if cluster.trainer.num_gpus > 0 and not cluster.colocate else "gloo"
        bucket = int(cluster.weight_sync_bucket_mb * 2**20)
        return RayGroup(engines.fleet, trainer.workers, bucket, backend)  # type: ignore[attr-defined]
    return InProcess(engines, trainer, info)  # type: ignore[arg-type]


class Handoff:
    """This rank's side of what passes between `engines` (rank 0's runtime; None on the other ranks and
    until it opens) and its `trainer`: the devices, when `colocated` (every device move is a no-op on
    separate devices or with async engines that keep generating), and the weights, by `transport`."""

    def __init__(
        self,
        engines: Runtime | None,
        trainer: Trainer,
        info: DistInfo,
        colocated: bool,
        transport: Transport | None = None,
    ):
        self.engines, self.trainer, self.info, self.colocated = engines, trainer, info, colocated
        self.transport = transport or InProcess(engines, trainer, info)
        self.trainer_away = False  # the trainer's state is off its devices (the engines use them)
        self.lent = True  # the engines freed their memory at the last sleep (rank 0's word, on every rank)

    def before_engines(self) -> None:
        """At the start of a run, before the runtime opens its engines (which size their KV cache by the
        free memory): every rank's trainer state off its devices, for both backends."""
        if self.colocated:
            self.trainer_away = bool(self.trainer.offload("all"))
            barrier(self.info)

    def to_trainer(self) -> dict[str, float]:
        """Before the update: the engines sleep, then every rank's state comes back. Engines that freed
        nothing (no sleep mode, or on a CPU) lend nothing: the trainer's state then stays where it is
        (comes back only if it was away) and is not sent away after the update either."""
        if not self.colocated:
            return {}
        asleep = self._engines_sleep(discard_weights=self.trainer.sends == FULL_SYNC)
        self.lent = asleep > 0
        self._trainer_back()
        return {"colocate/engines_asleep": float(asleep)}

    def to_sync(self) -> None:
        """After the update: the optimizer state off every rank, then the engines' weights back."""
        if self.colocated and self.lent:
            self.trainer.offload("optimizer")
            barrier(self.info)
            if self.engines is not None:
                self.engines.wake_weights()

    def to_engines(self) -> None:
        """After the sync: the trainer's parameters off every rank, then the engines' KV cache back."""
        if self.colocated and self.lent:
            self.trainer_away = bool(self.trainer.offload("params"))
            barrier(self.info)
            if self.engines is not None:
                self.engines.wake_up()

    async def sync(self, versions: WeightVersions | None, version: int, off_loop: bool) -> dict[str, float]:
        """The updated weights into the engines by the transport picked when the runtime opened, every
        rank taking part. With rank 0's `versions` the engines' sync gate is held meanwhile (turns in
        flight go on under the new weights: partial rollouts); `off_loop`: the sync runs in a thread
        while the event loop keeps the rollouts going (async)."""
        if versions is None:
            return self.transport.send()
        async with versions.syncing(version):
            return await asyncio.to_thread(self.transport.send) if off_loop else self.transport.send()

    @contextmanager
    def trainer_resident(self) -> Iterator[None]:
        """The trainer's state on its devices meanwhile (the KL reference's snapshot), the engines' after."""
        if not self.colocated:
            yield
            return
        self.lent = self._engines_sleep(discard_weights=False) > 0
        self._trainer_back()
        yield
        if self.lent:
            self.trainer_away = bool(self.trainer.offload("all"))
            barrier(self.info)
            if self.engines is not None:
                self.engines.wake_up()

    def _trainer_back(self) -> None:
        if self.trainer_away or self.lent:
            self.trainer.onload()
            self.trainer_away = False

    def _engines_sleep(self, discard_weights: bool) -> int:
        """rank 0's engines asleep, then every rank past the gate with how many could."""
        asleep = self.engines.sleep(discard_weights=discard_weights) if self.engines is not None else 0
        return int(broadcast_object(asleep, self.info))


def handoff_for(
    engines: Runtime | None, trainer: Trainer, info: DistInfo, cluster: ClusterConfig, async_: bool
) -> Handoff:
    """The handoff between a trainer and engines that are open already (a caller's runtime)."""
    transport = pick_transport(engines, trainer, info, cluster)
    return Handoff(engines, trainer, info, _takes_turns(cluster, async_), transport)


@asynccontextmanager
async def open_handoff(
    trainer: Trainer,
    info: DistInfo,
    cluster: ClusterConfig,
    async_: bool,
    open_engines: Callable[[], AbstractAsyncContextManager[Runtime | None]],
) -> AsyncIterator[Handoff]:
    """The start of a run, in its one order for both backends: every rank's trainer state off its
    devices (colocated), then the runtime opened (rank 0's engines start on those devices and size their
    KV cache by the memory the trainer left free) and the transport picked; at the end it is closed
    before the runtime."""
    handoff = Handoff(None, trainer, info, _takes_turns(cluster, async_))
    handoff.before_engines()
    async with open_engines() as engines:
        handoff.engines = engines
        handoff.transport = pick_transport(engines, trainer, info, cluster)
        try:
            yield handoff
        finally:
            handoff.transport.close()
