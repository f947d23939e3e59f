"""The version gate with stand-in engines (tirl.engines.versions): which version a turn and a group are
stamped with, busy time, syncs one at a time behind a barrier; see docs/mutation.md. With a real engine:
tests/rl/test_async_rollout.py and tests/rl/test_async_exact.py."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import pytest
from tests.event_loop import settle

from tirl.engines.base import Generation, SamplingParams
from tirl.engines.versions import EngineActivity, VersionedPool, VersionSpan, WeightVersions

pytestmark = pytest.mark.timeout(60)


def test_a_span_records_the_oldest_and_newest_version():
    span = VersionSpan()
    assert (span.oldest, span.newest, span.behind(7)) == (None, None, 0)
    for v in (3, 1, 5, 2):
        span.record(v)
    assert (span.oldest, span.newest) == (1, 5)
    assert span.behind(4) == 3 and span.behind(1) == 0
    one = VersionSpan()
    one.record(0)
    assert (one.oldest, one.newest, one.behind(2)) == (0, 0, 2)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_busy_time_counts_while_at_least_one_turn_generates():
    clock = Clock()
    wv = WeightVersions(3, clock=clock)
    assert wv.version == 3 and wv.snapshot() == EngineActivity(0.0, 0)
    async with wv.generating() as v1:
        assert v1 == 3
        clock.now += 2
        async with wv.generating() as v2:
            assert v2 == 3
            clock.now += 1
        clock.now += 1
        assert wv.snapshot().busy_s == 4.0  # still running: counted up to now
    clock.now += 10  # idle: not counted
    async with wv.generating():
        clock.now += 0.5
    wv.generated(7)
    wv.generated(5)
    assert wv.snapshot() == EngineActivity(4.5, 12)


async def test_a_failed_turn_still_ends_its_busy_time():
    clock = Clock()
    wv = WeightVersions(clock=clock)
    with pytest.raises(RuntimeError):
        async with wv.generating():
            clock.now += 3
            raise RuntimeError("engine died")
    clock.now += 5
    assert wv.snapshot().busy_s == 3.0 and wv.version == 0


async def test_a_sync_sets_the_version_after_loading_and_not_on_failure():
    wv = WeightVersions(1)
    async with wv.syncing(2):
        assert wv.version == 1  # the weights are loading
    assert wv.version == 2
    with pytest.raises(OSError):
        async with wv.syncing(3):
            raise OSError("load failed")
    assert wv.version == 2


async def test_syncs_run_one_at_a_time_and_wait_for_the_barrier():
    wv = WeightVersions(0)
    log = []
    gate = asyncio.Event()

    async def barrier():
        log.append("barrier")
        await gate.wait()

    wv.hold_syncs(barrier)

    async def sync(v):
        async with wv.syncing(v):
            log.append(f"load {v}")
            await asyncio.sleep(0)
            log.append(f"loaded {v}")

    tasks = [asyncio.create_task(sync(1)), asyncio.create_task(sync(2))]
    await settle()
    assert log == ["barrier"] and wv.version == 0  # held: the second sync waits for the lock
    gate.set()
    await asyncio.gather(*tasks)
    assert log == ["barrier", "load 1", "loaded 1", "barrier", "load 2", "loaded 2"] and wv.version == 2
    wv.hold_syncs(None)
    gate.clear()
    async with wv.syncing(3):
        pass
    assert wv.version == 3


class ToyEngine:
    name = "toy"

    def __init__(self):
        self.release = asyncio.Event()
        self.release.set()

    async def generate(self, prompt_ids, params):
        await self.release.wait()
        return Generation([1, 2, 3], [-0.1, -0.2, -0.3], "stop", version=99)

    def capacity(self):
        return "cap"


class ToyPool:
    def __init__(self, engine):
        self.engine = engine
        self.leases = []

    @asynccontextmanager
    async def lease(self, group, max_tokens):
        self.leases.append((group, max_tokens))
        yield self.engine


async def test_a_versioned_pool_stamps_each_generation_with_its_start_version():
    engine, wv, span = ToyEngine(), WeightVersions(4), VersionSpan()
    pool = VersionedPool(ToyPool(engine), wv, span)
    async with pool.lease("g#1", 64) as leased:
        assert leased.name == "toy" and leased.capacity() == "cap"  # the engine's own attributes
        engine.release.clear()
        turn = asyncio.create_task(leased.generate([0], SamplingParams()))
        await settle()
        async with wv.syncing(5):  # lands mid-generation
            pass
        engine.release.set()
        gen = await turn
        assert gen.version == 4 and gen.token_ids == [1, 2, 3] and gen.logprobs == [-0.1, -0.2, -0.3]
        assert (await leased.generate([0], SamplingParams())).version == 5
    assert pool.pool.leases == [("g#1", 64)]
    assert (span.oldest, span.newest) == (4, 5)
    assert wv.snapshot().tokens == 6
    no_span = VersionedPool(ToyPool(engine), wv)
    async with no_span.lease("g", 1) as leased:
        assert (await leased.generate([0], SamplingParams())).version == 5
    assert no_span.span is None


async def test_a_versioned_engine_passes_the_prompt_and_sampling_params_through():
    seen = []

    class Recorder:
        async def generate(self, prompt_ids, params):
            seen.append((prompt_ids, params))
            return Generation([1], [-0.1], "stop")

    params = SamplingParams(temperature=0.5, seed=9)
    async with VersionedPool(ToyPool(Recorder()), WeightVersions(2)).lease("g", 8) as leased:
        gen = await leased.generate([4, 5], params)
    assert seen == [([4, 5], params)] and gen.version == 2
