"""The asynchronous producer and the version gate with a fake agent loop (no model, no tokenizer):
tirl.engines.versions (which version a turn and a group are stamped with, busy time, syncs one at a
time behind a barrier) and tirl.rl.async_rollout (admission up to (k + 1) * P, seeds, first complete
first taken, staleness dropped only above k, retries waited for at k, metrics, failures, the exact
mode's batches and sync barrier, the state a checkpoint stores and resumes from); see
docs/mutation.md."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

import tirl.rl.async_rollout as ar
from tirl.agent.config import AgentConfig
from tirl.agent.trajectory import Trajectory
from tirl.data.problem import Problem
from tirl.engines.base import Generation, SamplingParams
from tirl.engines.versions import EngineActivity, VersionedPool, VersionSpan, WeightVersions
from tirl.rl.async_rollout import Draw, GroupProducer, StepGroups
from tirl.rl.sampler import EpochSampler
from tirl.seeds import derive_seed

pytestmark = pytest.mark.timeout(60)

PROBLEMS = [Problem(f"p{i}", f"q{i}", str(i)) for i in range(8)]
AGENT = AgentConfig(max_turns=2, max_response_tokens=64)


async def settle(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# ---- tirl.engines.versions ----


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


# ---- tirl.rl.async_rollout with a fake agent loop ----


@dataclass
class Env:
    """The fake agent loop's controls: per-draw gates on each turn, failures, what it was called with."""

    turns: int = 1
    holds: dict[tuple[int, int], asyncio.Event] = field(default_factory=dict)  # (draw, turn) -> gate
    before: dict[tuple[int, int], asyncio.Event] = field(default_factory=dict)  # gate before a turn starts
    fail: set[int] = field(default_factory=set)
    calls: list[tuple[str, int, int]] = field(default_factory=list)  # (group, sample_index, seed)
    selects: list[tuple[int, int]] = field(default_factory=list)  # (group size, seed)
    seen: list[Trajectory] = field(default_factory=list)
    passed: list[tuple] = field(default_factory=list)  # (tokenizer, executor, agent) per trajectory

    def hold(self, draw: int, turn: int = 0) -> asyncio.Event:
        return self.holds.setdefault((draw, turn), asyncio.Event())


class GateEngine:
    def __init__(self, env: Env):
        self.env = env

    async def generate(self, prompt_ids, params):
        draw, turn = prompt_ids
        if (draw, turn) in self.env.holds:
            await self.env.holds[(draw, turn)].wait()
        if draw in self.env.fail:
            raise RuntimeError(f"draw {draw} failed")
        return Generation([10 + turn] * 2, [-0.5, -0.5], "stop")


class GatePool:
    def __init__(self, env: Env):
        self.engine = GateEngine(env)

    @asynccontextmanager
    async def lease(self, group, max_tokens):
        yield self.engine


class Scorer:
    async def score_many(self, pairs):
        return [1.0 if text == ref else 0.0 for text, ref in pairs]


@dataclass
class Runtime:
    pool: GatePool
    tokenizer: object = None
    executor: object = None
    scorer: Scorer = field(default_factory=Scorer)


@pytest.fixture
def env(monkeypatch) -> Env:
    env = Env()

    async def run_trajectory(pool, tokenizer, executor, problem, agent, *, group, sample_index, seed):
        env.calls.append((group, sample_index, seed))
        env.passed.append((tokenizer, executor, agent))
        draw = int(group.rsplit("#", 1)[1])
        traj = Trajectory(problem.id, [1], sample_index=sample_index, response_text=problem.answer)
        async with pool.lease(group, agent.max_response_tokens) as engine:
            for turn in range(env.turns):
                if (draw, turn) in env.before:
                    await env.before[(draw, turn)].wait()
                gen = await engine.generate([draw, turn], SamplingParams(seed=seed))
                traj.response_ids += gen.token_ids
                traj.loss_mask += [1] * len(gen.token_ids)
                traj.versions += [gen.version] * len(gen.token_ids)
        traj.turns = env.turns
        return traj

    monkeypatch.setattr(ar, "run_trajectory", run_trajectory)
    return env


def producer(env: Env, versions: WeightVersions | None = None, runtime=None, **kw) -> GroupProducer:
    def select(group, seed):
        env.selects.append((len(group), seed))
        return [len(group) - 1]

    args = dict(prompts_per_step=2, rollouts_per_prompt=2, max_staleness=1, seed=3, first_step=0, steps=5)
    args |= kw
    return GroupProducer(
        runtime or Runtime(GatePool(env)),
        versions or WeightVersions(0),
        PROBLEMS,
        EpochSampler(len(PROBLEMS), 11),
        AGENT,
        select,
        on_trajectory=env.seen.append,
        **args,
    )


def pending(p: GroupProducer) -> list[list]:
    return p.state_dict()["pending"]


def draws(step: StepGroups, p: GroupProducer) -> list[str]:
    return [pr.id for pr in step.problems]


async def step(p: GroupProducer, wv: WeightVersions, version: int) -> StepGroups:
    """One trainer step: take the groups at `version`, sync version + 1, tell the producer."""
    got = await p.take(version)
    async with wv.syncing(version + 1):
        pass
    p.synced(version + 1)
    return got


@pytest.mark.parametrize(
    ("k", "steps", "steps_done", "admitted"),
    [(1, 5, 0, 4), (0, 5, 0, 2), (2, 5, 0, 6), (1, 1, 0, 2), (1, 5, 4, 2), (3, 5, 3, 4), (1, 5, 5, 0)],
)
async def test_admission_is_k_plus_one_steps_ahead_and_never_past_the_stage(
    env, k, steps, steps_done, admitted
):
    p = producer(env, max_staleness=k, steps=steps, steps_done=steps_done)
    order = EpochSampler(len(PROBLEMS), 11).next(admitted)
    assert pending(p) == [[problem, i, False] for i, problem in enumerate(order)]
    assert p.state_dict()["next_index"] == admitted
    await p.close()


async def test_taken_groups_hold_their_room_until_the_sync(env):
    wv = WeightVersions(0)
    p = producer(env, wv)
    got = await p.take(0)
    assert [d[1] for d in pending(p)] == [2, 3]  # the taken two are not replaced before the sync
    assert p.room() == 0
    async with wv.syncing(1):
        pass
    p.synced(1)
    assert [d[1] for d in pending(p)] == [2, 3, 4, 5] and p.steps_done == 1
    assert len(got.groups) == 2
    await p.close()


async def test_seeds_follow_batch_and_slot_and_every_trajectory_is_scored(env):
    p = producer(env, seed=3, first_step=10)
    got = await p.take(0)
    calls = sorted(env.calls)
    order = EpochSampler(len(PROBLEMS), 11).next(4)
    expected = []
    for d in range(4):
        batch, slot = divmod(d, 2)
        rollout = derive_seed(3, 10 + batch)
        expected += [(f"p{order[d]}#{d}", j, derive_seed(rollout, slot, j)) for j in range(2)]
    assert calls == sorted(expected)
    select_seeds = {derive_seed(3, 10 + d // 2, d % 2) for d in range(4)}
    assert {s for _, s in env.selects} == select_seeds and {n for n, _ in env.selects} == {2}
    assert got.kept == [[1], [1]]
    assert len(env.seen) == 8
    for group in got.groups:
        assert [t.sample_index for t in group] == [0, 1]
        assert all(t.reward == 1.0 for t in group)  # the scorer's verdict: text == the reference
    assert [pr.id for pr in got.problems] == [f"p{order[0]}", f"p{order[1]}"]
    await p.close()


async def test_the_first_complete_groups_are_taken_and_handed_over_in_draw_order(env):
    wv = WeightVersions(0)
    for d in (0, 1):
        env.hold(d)
    env.hold(2)
    p = producer(env, wv)
    order = EpochSampler(len(PROBLEMS), 11).next(4)
    take = asyncio.create_task(p.take(0))
    await settle()
    assert not take.done()  # only draw 3 is complete: one group of two
    env.hold(2).set()
    got = await take
    assert [pr.id for pr in got.problems] == [f"p{order[2]}", f"p{order[3]}"]
    assert got.metrics["async/groups_ahead"] == 2
    for d in (0, 1):
        env.hold(d).set()
    await p.close()


async def test_staleness_at_exactly_k_is_kept_and_above_k_dropped_and_requeued_first(env):
    wv = WeightVersions(0)
    env.hold(0)  # draw 0's turn starts at version 0 and does not end
    p = producer(env, wv, prompts_per_step=1, max_staleness=1, steps=6)
    order = EpochSampler(len(PROBLEMS), 11).next(6)
    got = await step(p, wv, 0)  # draw 1 is complete; after the sync draw 0 is 1 = k behind: kept
    assert [pr.id for pr in got.problems] == [f"p{order[1]}"]
    assert pending(p)[0] == [order[0], 0, False]
    got = await p.take(1)  # still exactly k behind: kept (in flight); draw 2 is taken
    assert [pr.id for pr in got.problems] == [f"p{order[2]}"]
    assert got.metrics["async/dropped_stale"] == 0 and pending(p)[0] == [order[0], 0, False]
    async with wv.syncing(2):
        pass
    p.synced(2)  # 2 > k behind: dropped, its prompt re-queued first, with a fresh index (fresh seeds)
    assert pending(p) == [[order[0], 3, True], [order[3], 4, False]]
    got = await p.take(2)
    assert got.metrics["async/dropped_stale"] == 1
    assert p.state_dict()["next_index"] == 5
    await p.close()


async def test_a_dropped_group_is_requeued_before_new_draws_and_its_retry_trained(env):
    wv = WeightVersions(0)
    env.hold(0)
    p = producer(env, wv, prompts_per_step=1, max_staleness=0, steps=6)
    order = EpochSampler(len(PROBLEMS), 11).next(6)
    # k = 0: one group admitted at a time; draw 0 never finishes at version 0
    take = asyncio.create_task(p.take(0))
    await settle()
    assert not take.done()
    # the trainer cannot move on without it; let a sync happen out of band as a stale trainer would
    take.cancel()
    await asyncio.gather(take, return_exceptions=True)
    got = await p.take(1)  # draw 0 is 1 > 0 behind: dropped, retried at once (index 1) and trained
    assert got.metrics["async/dropped_stale"] == 1 and got.metrics["async/retries_trained"] == 1
    assert [pr.id for pr in got.problems] == [f"p{order[0]}"]
    assert [c[0] for c in env.calls][-2:] == [f"p{order[0]}#1"] * 2
    await p.close()


async def test_a_retry_due_at_k_is_waited_for_even_when_others_are_complete(env):
    wv = WeightVersions(0)
    env.hold(0)
    p = producer(env, wv, prompts_per_step=1, max_staleness=1, steps=8)
    order = EpochSampler(len(PROBLEMS), 11).next(8)
    await step(p, wv, 0)  # draw 1
    env.hold(3)  # draw 0's retry (index 3) will hang
    got = await step(p, wv, 1)  # draw 2; at the sync draw 0 (2 behind) is dropped: retry #3, then draw 4
    assert [pr.id for pr in got.problems] == [f"p{order[2]}"]
    got = await p.take(2)  # the retry started at version 2: not due yet; draw 4 is taken
    assert [pr.id for pr in got.problems] == [f"p{order[3]}"] and got.metrics["async/dropped_stale"] == 1
    async with wv.syncing(3):
        pass
    p.synced(3)
    # at version 3 the retry is 1 = k behind: due, and waited for although draw 5 is complete
    take = asyncio.create_task(p.take(3))
    await settle()
    assert not take.done()
    env.hold(3).set()
    got = await take
    assert [pr.id for pr in got.problems] == [f"p{order[0]}"]
    assert got.metrics["async/retries_trained"] == 1 and got.metrics["async/dropped_stale"] == 0
    assert got.metrics["async/staleness/1"] == 1
    env.hold(0).set()
    await p.close()


async def test_a_retry_is_never_dropped(env):
    wv = WeightVersions(0)
    p = producer(
        env,
        wv,
        prompts_per_step=1,
        max_staleness=0,
        steps=4,
        state={"pending": [[2, 5, True]], "next_index": 6},
    )
    env.hold(5)
    await settle()
    p._drop_stale(3)  # far behind, but a retry
    assert pending(p)[0] == [2, 5, True]
    env.hold(5).set()
    got = await p.take(3)
    assert got.metrics["async/dropped_stale"] == 0 and got.metrics["async/retries_trained"] == 1
    await p.close()


async def test_step_metrics_count_each_staleness_and_the_behaviour_versions(env):
    wv = WeightVersions(0)
    env.turns = 2
    env.before[(0, 1)] = asyncio.Event()  # draw 0's second turn starts after a sync
    p = producer(env, wv, prompts_per_step=2, max_staleness=1, steps=1)  # draws 0 and 1 only
    await settle()
    async with wv.syncing(1):
        pass
    env.before[(0, 1)].set()
    got = await p.take(1)
    m = got.metrics
    # draws 0 and 1: draw 0 spans versions 0..1 (behind 1), draw 1 ran at version 0 (behind 1)
    assert {k: v for k, v in m.items() if k.startswith("async/staleness/")} == {
        "async/staleness/0": 0,
        "async/staleness/1": 2,
    }
    assert (m["async/behaviour_version_min"], m["async/behaviour_version_max"]) == (0, 1)
    versions = sorted({v for g in got.groups for t in g for v in t.versions})
    assert versions == [0, 1]  # each turn keeps the version it started with
    assert m["async/groups_ahead"] == 0 and m["async/dropped_stale"] == 0
    await p.close()


async def test_metrics_list_ages_beyond_k_and_no_behaviour_version_without_turns(env):
    p = producer(env, max_staleness=0, prompts_per_step=1, steps=3)
    await settle()
    g = p._groups[0]
    g.span.record(0)
    g.span.record(2)
    m = p._metrics([g], 3)
    assert m["async/staleness/0"] == 0 and m["async/staleness/3"] == 1
    assert list(k for k in m if k.startswith("async/staleness/")) == [
        "async/staleness/0",
        "async/staleness/3",
    ]
    assert (m["async/behaviour_version_min"], m["async/behaviour_version_max"]) == (0, 2)
    empty = ar._Group(Draw(0, 9))
    m = p._metrics([empty], 3)
    assert m["async/behaviour_version_min"] is None and m["async/behaviour_version_max"] is None
    assert m["async/staleness/0"] == 1
    await p.close()


async def test_dropped_count_is_reported_once(env):
    p = producer(env, max_staleness=0, prompts_per_step=1, steps=3)
    p._dropped = 3
    g = await p.take(0)
    assert g.metrics["async/dropped_stale"] == 3
    assert p._metrics([], 0)["async/dropped_stale"] == 0
    await p.close()


async def test_a_failed_trajectory_fails_the_step(env):
    env.fail.add(1)
    p = producer(env)
    with pytest.raises(RuntimeError, match="draw 1 failed"):
        await p.take(0)
    await p.close()


async def test_state_dict_and_resume_from_it(env):
    p = producer(
        env,
        prompts_per_step=1,
        max_staleness=2,
        steps=9,
        state={"pending": [[5, 7, True], [1, 8, False]], "next_index": 9},
    )
    new = EpochSampler(len(PROBLEMS), 11).next(1)[0]
    assert p.state_dict() == {"pending": [[5, 7, True], [1, 8, False], [new, 9, False]], "next_index": 10}
    await settle()
    assert sorted(c[0] for c in env.calls) == sorted(["p5#7"] * 2 + ["p1#8"] * 2 + [f"p{new}#9"] * 2)
    await p.close()
    assert p.state_dict() == {"pending": [], "next_index": 10}


async def test_queued_draws_beyond_the_room_stay_in_the_state(env):
    state = {"pending": [[1, 3, False], [2, 4, False], [3, 5, True]], "next_index": 6}
    p = producer(env, prompts_per_step=1, max_staleness=0, steps=9, state=state)
    assert p.state_dict() == {"pending": [[1, 3, False], [2, 4, False], [3, 5, True]], "next_index": 6}
    assert len(p._groups) == 1
    await p.close()


async def test_close_cancels_the_groups_in_flight(env):
    env.hold(0)
    p = producer(env)
    await settle()
    tasks = [g.task for g in p._groups.values()]
    await p.close()
    assert tasks[0].cancelled() and all(t.done() for t in tasks)


async def test_exact_mode_takes_its_own_batch_and_holds_syncs_until_all_admitted_are_done(env):
    wv = WeightVersions(0)
    env.hold(3)
    p = producer(env, wv, exact=True, prompts_per_step=2, max_staleness=1, steps=4)
    order = EpochSampler(len(PROBLEMS), 11).next(4)
    got = await p.take(0)
    assert [pr.id for pr in got.problems] == [f"p{order[0]}", f"p{order[1]}"]
    sync = asyncio.create_task(wv.syncing(1).__aenter__())
    await settle()
    assert not sync.done()  # draw 3 is still generating
    env.hold(3).set()
    await sync
    assert wv.version == 0
    p.synced(1)
    got = await p.take(1)
    assert [pr.id for pr in got.problems] == [f"p{order[2]}", f"p{order[3]}"]
    await p.close()
    async with wv.syncing(2):  # after close, a sync does not wait for anything
        pass


async def test_exact_mode_never_drops(env):
    wv = WeightVersions(0)
    p = producer(env, wv, exact=True, prompts_per_step=1, max_staleness=0, steps=3)
    await settle()
    p._groups[0].span.record(0)
    p._drop_stale(5)
    assert 0 in p._groups and p._dropped == 0
    await p.close()


async def test_exact_mode_says_when_a_batch_was_never_admitted(env):
    p = producer(env, exact=True, prompts_per_step=2, max_staleness=0, steps=4, steps_done=1)
    with pytest.raises(RuntimeError) as err:
        await p.take(0)
    assert str(err.value) == "exact staleness: 2 group(s) of batch 1 were never admitted"
    await p.close()


async def test_all_done_raises_a_failed_group_while_another_still_runs(env):
    env.fail.add(0)
    env.hold(1)
    p = producer(env, exact=True, prompts_per_step=2, max_staleness=0, steps=2)
    try:
        with pytest.raises(RuntimeError, match="draw 0 failed"):  # at once: group 1 is still held
            await asyncio.wait_for(p.all_done(), 10)
    finally:
        env.hold(1).set()
        await p.close()


async def test_a_failure_of_the_last_group_in_flight_is_raised_not_waited_on(env):
    env.fail.add(0)
    p = producer(env, exact=True, prompts_per_step=1, max_staleness=0, steps=2)
    try:
        with pytest.raises(RuntimeError, match="draw 0 failed"):
            await asyncio.wait_for(p.all_done(), 2)
    finally:
        await p.close()


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


async def test_groups_are_taken_in_completion_order_not_admission_order(env):
    for d in range(4):
        env.hold(d)
    p = producer(env, prompts_per_step=2, max_staleness=1, steps=5)
    order = EpochSampler(len(PROBLEMS), 11).next(4)
    await settle()
    for d in (3, 2, 0):  # complete in this order: 3 and 2 first
        env.hold(d).set()
        await settle()
    got = await p.take(0)
    assert [pr.id for pr in got.problems] == [f"p{order[2]}", f"p{order[3]}"]  # handed over in draw order
    env.hold(1).set()
    await p.close()


async def test_the_agent_loop_gets_the_runtimes_tokenizer_and_executor_and_each_trajectory_is_seen(env):
    tokenizer, executor = object(), object()
    p = producer(env, runtime=Runtime(GatePool(env), tokenizer, executor), steps=1)
    got = await p.take(0)
    assert env.passed and all(x == (tokenizer, executor, AGENT) for x in env.passed)
    assert sorted(map(id, env.seen)) == sorted(id(t) for g in got.groups for t in g)
    await p.close()


async def test_exact_mode_waits_for_its_whole_batch_and_moves_through_every_batch(env):
    wv = WeightVersions(0)
    env.hold(0)
    p = producer(env, wv, exact=True, prompts_per_step=1, max_staleness=0, steps=3)
    order = EpochSampler(len(PROBLEMS), 11).next(3)
    take = asyncio.create_task(p.take(0))
    await settle()
    assert not take.done()  # batch 0 is draw 0, still generating
    env.hold(0).set()
    got = await take
    assert [pr.id for pr in got.problems] == [f"p{order[0]}"] and [len(g) for g in got.groups] == [2]
    async with wv.syncing(1):
        pass
    p.synced(1)
    for v in (1, 2):  # each sync moves the batch on by one: draw v is batch v
        got = await step(p, wv, v)
        assert [pr.id for pr in got.problems] == [f"p{order[v]}"] and p.steps_done == v + 1
    assert pending(p) == []  # the stage's three batches are all taken: nothing more admitted
    await p.close()


async def test_two_takes_before_a_sync_both_hold_their_room(env):
    p = producer(env, prompts_per_step=1, max_staleness=1, steps=5)
    first = await p.take(0)
    second = await p.take(0)  # a trainer taking the next step's groups before syncing
    assert len(first.groups) == len(second.groups) == 1
    assert p.room() == 0 and pending(p) == []  # both steps' groups count until the sync
    p.synced(1)
    assert [d[1] for d in pending(p)] == [2, 3]
    await p.close()


async def test_exact_mode_counts_the_missing_groups_of_a_partly_admitted_batch(env):
    # resumed with draw 2 of batch 1 pending; the other admitted draw is new (index 5): draw 3 is missing
    state = {"pending": [[0, 2, False]], "next_index": 5}
    p = producer(env, exact=True, prompts_per_step=2, max_staleness=0, steps=4, steps_done=1, state=state)
    assert [d[1] for d in pending(p)] == [2, 5]
    with pytest.raises(RuntimeError) as err:
        await p.take(1)
    assert str(err.value) == "exact staleness: 1 group(s) of batch 1 were never admitted"
    await p.close()
