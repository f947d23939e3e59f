"""Policy versions of the engines' weights, and the gate that keeps a weight sync out of a turn.

The trainer's policy version is the number of RL steps whose update reached the engines. Every turn a
trajectory generates through a `VersionedPool` records the version it was generated with
(`Generation.version`, then one entry per token in `Trajectory.versions`), so a trajectory whose turns
straddle a weight sync (a partial rollout in asynchronous training) keeps the version of each token.

`WeightVersions` is a readers-writer gate: generate calls are readers and run concurrently; a weight
sync is the writer: it waits until the turns in flight end, holds new turns back while the weights
load, bumps the version and lets them go. It also measures how long at least one turn was being
generated (the engines' busy time) for the idle-fraction metrics.

Departure from AReaL-style interruptible generation: weights change between turns, never inside one
(vLLM cannot swap weights under a running request without aborting and recomputing it); so a sync
waits for the longest turn in flight, and one turn's tokens always share one version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from tirl.engines.base import Engine, EnginePool, Generation, SamplingParams


class WeightVersions:
    """The engines' current policy version and the sync gate (one per event loop)."""

    def __init__(self, version: int = 0, clock: Callable[[], float] = time.monotonic):
        self.version = version
        self._clock = clock
        self._in_flight = 0
        self._syncing = False
        self._cond = asyncio.Condition()
        self._busy_s = 0.0
        self._busy_since: float | None = None

    @asynccontextmanager
    async def generating(self) -> AsyncIterator[int]:
        """Hold the gate open for one turn; yields the version the turn is generated with."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._syncing)
            if self._in_flight == 0:
                self._busy_since = self._clock()
            self._in_flight += 1
        try:
            yield self.version
        finally:
            async with self._cond:
                self._in_flight -= 1
                if self._in_flight == 0 and self._busy_since is not None:
                    self._busy_s += self._clock() - self._busy_since
                    self._busy_since = None
                self._cond.notify_all()

    @asynccontextmanager
    async def syncing(self, version: int) -> AsyncIterator[None]:
        """Drain the turns in flight, hold new ones while the body loads the weights, then set `version`
        (only if the body succeeded: a failed sync leaves the engines' version as it was)."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._syncing)
            self._syncing = True
            await self._cond.wait_for(lambda: self._in_flight == 0)
        try:
            yield
            self.version = version
        finally:
            async with self._cond:
                self._syncing = False
                self._cond.notify_all()

    def busy_seconds(self) -> float:
        """Total time at least one turn was being generated (engines busy), up to now."""
        running = self._clock() - self._busy_since if self._busy_since is not None else 0.0
        return self._busy_s + running


class _VersionedEngine:
    """The leased engine with every generate call passing the gate and stamped with its version."""

    def __init__(self, engine: Engine, versions: WeightVersions, on_version: Callable[[int], None] | None):
        self._engine = engine
        self._versions = versions
        self._on_version = on_version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        async with self._versions.generating() as version:
            if self._on_version is not None:
                self._on_version(version)
            generation = await self._engine.generate(prompt_ids, params)
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
