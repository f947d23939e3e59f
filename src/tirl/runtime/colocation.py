"""Colocation: engines and trainer ranks take turns on the same devices, in the one safe order.

Engine i shares trainer rank i's GPU (torchrun: engine i on cuda:i next to rank i; Ray: one bundle).
Around each update the engines lend their memory to the trainer and get it back for the sync:

    engines sleep, all at once              (weights discarded when a full sync rewrites them; kept
                                             when the learner sends only the LoRA-adapted layers)
    -- barrier --                           (no rank takes memory its engine still holds)
    trainer parameters + optimizer state on the device; the update
    optimizer state off the device          (every rank)
    -- barrier --                           (no engine wakes into memory its rank still holds)
    engines wake their weights; the sync writes into them
    trainer parameters off the device
    -- barrier --
    engines wake their KV cache

A checkpoint needs the trainer's state where FSDP2 sharded it (gathering host shards over the NCCL
group fails), so it borrows the devices the same way, engines keeping their weights (no sync follows).
Only rank 0 holds the engines (`engines` is None elsewhere); every rank moves its own trainer state,
and the barriers make the others wait for it. On Ray one driver call moves every rank at once (the
call returns when all did), so its barrier is the call itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from tirl.distributed.groups import barrier
from tirl.distributed.weight_sync import FULL_SYNC, SyncKind

if TYPE_CHECKING:
    from tirl.distributed.groups import DistInfo
    from tirl.runtime.base import Runtime
    from tirl.runtime.config import ClusterConfig


def lends_devices(cluster: ClusterConfig, async_: bool) -> bool:
    """Whether engines lend their devices to the trainer around each update: they share them
    (cluster.engines_share_devices) and are synchronous (async engines keep generating meanwhile)."""
    return cluster.engines_share_devices and not async_


class Borrower(Protocol):
    """The trainer side (tirl.rl.learner.Learner): where its state lives and what its sync carries."""

    sends: SyncKind

    def offload(self, what: str = "all") -> bool: ...

    def onload(self) -> bool: ...


class Colocation:
    """The devices' hand-over between `engines` (rank 0's runtime; None on the other ranks) and this
    rank's `trainer`; every method is a no-op when `active` is False (separate devices, or async
    engines that keep generating)."""

    def __init__(self, engines: Runtime | None, trainer: Borrower, info: DistInfo, active: bool):
        self.engines, self.trainer, self.info, self.active = engines, trainer, info, active

    def to_trainer(self) -> dict[str, float]:
        """Before the update: the engines sleep, then every rank's state comes back."""
        if not self.active:
            return {}
        asleep = self._engines_sleep(discard_weights=self.trainer.sends == FULL_SYNC)
        self.trainer.onload()
        return {} if asleep is None else {"colocate/engines_asleep": float(asleep)}

    def to_sync(self) -> None:
        """After the update: the optimizer state off every rank, then the engines' weights back."""
        if self.active:
            self.trainer.offload("optimizer")
            barrier(self.info)
            if self.engines is not None:
                self.engines.wake_weights()

    def to_engines(self) -> None:
        """After the sync: the trainer's parameters off every rank, then the engines' KV cache back."""
        if self.active:
            self.trainer.offload("params")
            barrier(self.info)
            if self.engines is not None:
                self.engines.wake_up()

    @contextmanager
    def trainer_resident(self) -> Iterator[None]:
        """The trainer's state on its devices meanwhile (a checkpoint), the engines' after."""
        if not self.active:
            yield
            return
        self._engines_sleep(discard_weights=False)
        self.trainer.onload()
        yield
        self.trainer.offload("all")
        barrier(self.info)
        if self.engines is not None:
            self.engines.wake_up()

    def _engines_sleep(self, discard_weights: bool) -> int | None:
        """rank 0's engines asleep (how many could), then every rank past the barrier."""
        asleep = self.engines.sleep(discard_weights=discard_weights) if self.engines is not None else None
        barrier(self.info)
        return asleep
