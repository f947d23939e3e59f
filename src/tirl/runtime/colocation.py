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

At the start of a run every rank's state leaves its devices before the runtime opens the engines
(`open_lending`, both backends), so they size their KV cache with the trainer's memory free; it comes
back at the first update. Engines that freed nothing when asked to sleep (no sleep mode, a CPU) lend
nothing: the trainer's state then stays on its devices. A checkpoint is written right after the
update (tirl.rl.trainer.rl_step), where the state already is on its devices and the engines asleep; the
KL reference's snapshot and a resume's restore borrow the devices the same way as an update, engines
keeping their weights (no sync follows).
Only rank 0 holds the engines (`engines` is None elsewhere); every rank moves its own trainer state,
and the barriers make the others wait for it. On Ray one driver call moves every rank at once (the
call returns when all did), so its barrier is the call itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Protocol

from tirl.distributed.groups import barrier, broadcast_object
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
    """The devices' hand-over between `engines` (rank 0's runtime; None on the other ranks and until
    it opens) and this rank's `trainer`; every method is a no-op when `active` is False (separate
    devices, or async engines that keep generating)."""

    def __init__(self, engines: Runtime | None, trainer: Borrower, info: DistInfo, active: bool):
        self.engines, self.trainer, self.info, self.active = engines, trainer, info, active
        self.trainer_away = False  # the trainer's state is off its devices (the engines use them)
        self.lent = True  # the engines freed their memory at the last sleep (rank 0's word, on every rank)

    def before_engines(self) -> None:
        """At the start of a run, before the runtime opens its engines (which size their KV cache by the
        free memory): every rank's trainer state off its devices, for both backends."""
        if self.active:
            self.trainer_away = bool(self.trainer.offload("all"))
            barrier(self.info)

    def to_trainer(self) -> dict[str, float]:
        """Before the update: the engines sleep, then every rank's state comes back. Engines that freed
        nothing (no sleep mode, or on a CPU) lend nothing: the trainer's state then stays where it is
        (comes back only if it was away) and is not sent away after the update either."""
        if not self.active:
            return {}
        asleep = self._engines_sleep(discard_weights=self.trainer.sends == FULL_SYNC)
        self.lent = asleep > 0
        self._trainer_back()
        return {"colocate/engines_asleep": float(asleep)}

    def to_sync(self) -> None:
        """After the update: the optimizer state off every rank, then the engines' weights back."""
        if self.active and self.lent:
            self.trainer.offload("optimizer")
            barrier(self.info)
            if self.engines is not None:
                self.engines.wake_weights()

    def to_engines(self) -> None:
        """After the sync: the trainer's parameters off every rank, then the engines' KV cache back."""
        if self.active and self.lent:
            self.trainer_away = bool(self.trainer.offload("params"))
            barrier(self.info)
            if self.engines is not None:
                self.engines.wake_up()

    @contextmanager
    def trainer_resident(self) -> Iterator[None]:
        """The trainer's state on its devices meanwhile (the KL reference's snapshot), the engines' after."""
        if not self.active:
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


@asynccontextmanager
async def open_lending(
    trainer: Borrower,
    info: DistInfo,
    active: bool,
    open_engines: Callable[[], AbstractAsyncContextManager[Runtime | None]],
) -> AsyncIterator[Colocation]:
    """The start of a run, in its one order for both backends: every rank's trainer state off its
    devices, then the runtime opened (rank 0's engines start on those devices and size their KV cache
    by the memory the trainer left free), then the hand-overs of each step."""
    lending = Colocation(None, trainer, info, active)
    lending.before_engines()
    async with open_engines() as engines:
        lending.engines = engines
        yield lending
