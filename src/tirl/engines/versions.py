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
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from tirl.engines.base import Engine, EnginePool, Generation, SamplingParams


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

    def __init__(self, engine: Engine, versions: WeightVersions, on_version: Callable[[int], None] | None):
        self._engine = engine
        self._versions = versions
        self._on_version = on_version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        async with self._versions.generating() as version:
            if self._on_version is not None:
                self._on_version(version)
            generation = await self._engine.generate(prompt_ids, params)
        self._versions.generated(len(generation.token_ids))
        return dataclasses.replace(generation, version=version)

    def __getattr__(self, name: str) -> Any:  # capacity, name, ...
        return getattr(self._engine, name)


class VersionedPool:
    """An EnginePool whose engines generate through the gate of `versions`. `on_version(group, v)` is told
    the version of every turn as it starts (the producer tracks each group's oldest token with it)."""

    def __init__(
        self,
        pool: EnginePool,
        versions: WeightVersions,
        on_version: Callable[[str, int], None] | None = None,
    ):
        self.pool = pool
        self.versions = versions
        self._on_version = on_version

    @asynccontextmanager
    async def lease(self, group: str, max_tokens: int) -> AsyncIterator[Engine]:
        report = None if self._on_version is None else (lambda v: self._on_version(group, v))
        async with self.pool.lease(group, max_tokens) as engine:
            yield _VersionedEngine(engine, self.versions, report)
