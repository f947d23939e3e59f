"""Failover over a run's engines that can fail on their own (Ray engine actors: tirl.runtime.ray;
inference servers by URL: tirl.engines.remote): which are up, where a turn of a failed engine goes,
and when one that came back rejoins, with the counters the metrics show (`infra/engine_failures`,
`infra/engine_restarts`, `infra/rerouted_turns`).

An engine that failed holds weights the next sync may not reach: it gets no work until a sync brought
it the current ones (`synced`). A turn it cannot finish runs on the live engine with the most free KV
cache, with the same prompt tokens and seed, so no trajectory is lost or scored on a broken turn.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

from tirl.engines.base import Generation, KVCapacity, SamplingParams

log = logging.getLogger(__name__)
COUNTERS = ("engine_failures", "engine_restarts", "rerouted_turns")


class Member(Protocol):
    """An engine of a fleet."""

    name: str
    up: bool  # serving, with the fleet's current weights
    revived: bool  # answering again after a failure, its weights not synced yet

    def capacity(self) -> KVCapacity: ...

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...


class NoLiveEngineError(RuntimeError):
    """Every engine of the fleet is down: no turn can run."""


class EngineFleet:
    """The engines of one run and their failover; `counters` is the runtime's (shown as infra/*)."""

    def __init__(self, counters: dict[str, int] | None = None):
        self.engines: list[Any] = []
        self.counters = counters if counters is not None else {}
        for key in COUNTERS:
            self.counters.setdefault(key, 0)

    def lost(self, engine: Member, why: str) -> bool:
        """`engine` failed: no more work for it; True when it was up until now."""
        if not engine.up:
            return False
        engine.up, engine.revived = False, False
        self.counters["engine_failures"] += 1
        log.warning("%s is down: %s; its turns go to the other engines", engine.name, why)
        return True

    def synced(self, engines: Iterable[Member]) -> None:
        """A sync reached `engines`: those that were down are up again, with the current weights."""
        for e in engines:
            if not e.up:
                e.up, e.revived = True, False
                self.counters["engine_restarts"] += 1

    async def reroute(self, failed: Member, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """The turn `failed` could not run, on the live engine with the most free KV cache."""
        live = [e for e in self.engines if e.up and e is not failed]
        if not live:
            raise self.none_live()
        self.counters["rerouted_turns"] += 1
        target = max(live, key=lambda e: e.capacity().free_tokens or 0)
        return await target.generate(prompt_ids, params)

    def none_live(self) -> Exception:
        """The error when no engine is left (each kind of fleet names what to check)."""
        return NoLiveEngineError(f"every engine is down ({', '.join(e.name for e in self.engines)})")
