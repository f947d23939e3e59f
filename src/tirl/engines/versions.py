"""Policy versions of the engines' weights: which weights generated each token.

The trainer's policy version is the number of RL steps whose update reached the engines. Every turn a
trajectory generates through a `VersionedPool` records the version the engines held when the turn
started (`Generation.version`, then one entry per token in `Trajectory.versions`), so a trajectory
whose turns straddle a weight sync (a partial rollout in asynchronous training) keeps each turn's own
version. `WeightVersions` also measures how long at least one turn was being generated (the engines'
busy time) and how many tokens were generated, for the idle-fraction and throughput metrics.

A sync does not wait for the turns in flight: both engines load weights between two decode steps
(the HF engine under its model lock, vLLM between scheduler steps, recomputing running requests'
KV), so a request in flight goes on under the new weights, as in AReaL's and verl's partial
rollouts. Departure: such a turn records the version it STARTED with for all its tokens, a lower
bound on the truth (the engines cannot say which token came after the swap), so the staleness
bound is conservative (a group may be counted staler than it is, never fresher); the engine's
sampling log-probs that TIS weighs against are the true behaviour policy either way.

A rollout group's staleness has one definition, `VersionSpan`: the versions its turns started with,
recorded as each turn starts (so a group still in flight already has one) and equal to the minimum of
its trajectories' per-token versions once it is done. `WeightVersions.hold_syncs` lets the exact
staleness mode (tirl.rl.async_rollout) make a sync wait until no admitted group is generating, so that
no turn ever straddles a sync there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from tirl.engines.base import Engine, EnginePool, Generation, SamplingParams


@dataclass
class VersionSpan:
    """The policy versions the turns of one rollout group started with (None: no turn started yet)."""

    oldest: int | None = None
    newest: int | None = None

    def record(self, version: int) -> None:
        self.oldest = version if self.oldest is None else min(self.oldest, version)
        self.newest = version if self.newest is None else max(self.newest, version)

    def behind(self, version: int) -> int:
        """How many versions the oldest turn is behind `version` (0 before any turn started)."""
        return 0 if self.oldest is None else version - self.oldest


SyncBarrier = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class EngineActivity:
    busy_s: float  # time at least one turn was being generated
    tokens: int  # tokens generated


class WeightVersions:
    """The engines' current policy version, and their busy time (one per event loop)."""

    def __init__(self, version: int = 0, clock: Callable[[], float] = time.monotonic):
        self.version = version
        self._clock = clock
        self._in_flight = 0
        self._busy_s = 0.0
        self._busy_since: float | None = None
        self._tokens = 0
        self._sync = asyncio.Lock()
        self._barrier: SyncBarrier | None = None

    def hold_syncs(self, barrier: SyncBarrier | None) -> None:
        """Every sync first awaits `barrier` (None: syncs land at once, mid-generation if need be)."""
        self._barrier = barrier

    @asynccontextmanager
    async def generating(self) -> AsyncIterator[int]:
        """Around one turn's generation: yields the version it starts with; counts the engines busy."""
        if self._in_flight == 0:
            self._busy_since = self._clock()
        self._in_flight += 1
        try:
            yield self.version
        finally:
            self._in_flight -= 1
            if self._in_flight == 0 and self._busy_since is not None:
                self._busy_s += self._clock() - self._busy_since
                self._busy_since = None

    @asynccontextmanager
    async def syncing(self, version: int) -> AsyncIterator[None]:
        """Around loading the weights of `version` into the engines (one sync at a time): turns that start
        after it record `version`; a failed sync leaves the engines' version as it was."""
        async with self._sync:
            if self._barrier is not None:
                await self._barrier()
            yield
            self.version = version

    def generated(self, tokens: int) -> None:
        self._tokens += tokens

    def snapshot(self) -> EngineActivity:
        """Busy time and generated tokens so far (metrics take differences of two snapshots)."""
        running = self._clock() - self._busy_since if self._busy_since is not None else 0.0
        return EngineActivity(self._busy_s + running, self._tokens)


class _VersionedEngine:
    """The leased engine, every generation stamped with the version it started with."""

    def __init__(self, engine: Engine, versions: WeightVersions, span: VersionSpan | None):
        self._engine = engine
        self._versions = versions
        self._span = span

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        async with self._versions.generating() as version:
            if self._span is not None:
                self._span.record(version)
            generation = await self._engine.generate(prompt_ids, params)
        self._versions.generated(len(generation.token_ids))
        return dataclasses.replace(generation, version=version)

    def __getattr__(self, name: str) -> Any:  # capacity, name, ...
        return getattr(self._engine, name)


class VersionedPool:
    """An EnginePool whose engines generate through the gate of `versions`; every turn's start version is
    recorded in `span` (one pool per rollout group: the producer reads the group's staleness from it)."""

    def __init__(self, pool: EnginePool, versions: WeightVersions, span: VersionSpan | None = None):
        self.pool = pool
        self.versions = versions
        self.span = span

    @asynccontextmanager
    async def lease(self, group: str, max_tokens: int) -> AsyncIterator[Engine]:
        async with self.pool.lease(group, max_tokens) as engine:
            yield _VersionedEngine(engine, self.versions, self.span)
