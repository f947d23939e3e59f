"""Streaming and asynchronous rollouts: the weight-sync gate, per-token policy versions across a sync
(partial rollouts), the group producer against today's generate-then-score step, and the staleness
bound (a stale group dropped, its prompt re-queued and trained later). Real tiny model on the HF
engine, real sandbox and math-verify; tests wait on events, never on time. Then the producer's rules
pinned with a fake agent loop (no model; see docs/mutation.md)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import pytest_asyncio
from pydantic import ValidationError
from tests.event_loop import settle
from tests.rl.held_tool import Hold

import tirl.rl.async_rollout as ar
from tirl.agent.config import AgentConfig
from tirl.agent.loop import run_trajectory
from tirl.agent.trajectory import Trajectory
from tirl.data.problem import Problem
from tirl.engines.base import Generation, KVCapacity, SamplingParams, SingleEnginePool
from tirl.engines.config import EngineConfig
from tirl.engines.versions import VersionedPool, WeightVersions
from tirl.reward import RewardConfig
from tirl.rl.async_rollout import Draw, GroupProducer, StepGroups
from tirl.rl.config import AlgorithmConfig, TrainConfig
from tirl.rl.sampler import EpochSampler
from tirl.rl.trainer import roc_select
from tirl.runtime import generate_scored, open_runtime
from tirl.runtime.config import ClusterConfig
from tirl.sandbox import SandboxConfig
from tirl.seeds import derive_seed

pytestmark = pytest.mark.timeout(600)
session_loop = pytest.mark.asyncio(loop_scope="session")  # the module-scoped runtime lives on it

PROBLEMS = [Problem(f"p{i}", f"What is {i} + {i}?", str(2 * i)) for i in range(6)]
AGENT = AgentConfig(max_turns=2, max_response_tokens=12)


@session_loop
async def test_a_turn_keeps_the_version_it_started_with_across_a_sync():
    """A sync does not wait for the turn in flight (engines swap weights between decode steps): that turn
    keeps its start version (a lower bound), the next turn gets the new one; busy time counts both."""
    ticks = iter(range(100))
    versions = WeightVersions(3, clock=lambda: float(next(ticks)))
    in_turn, end_turn = asyncio.Event(), asyncio.Event()
    seen: list[int] = []

    async def turn(hold: bool):
        async with versions.generating() as v:
            seen.append(v)
            if hold:
                in_turn.set()
                await end_turn.wait()

    first = asyncio.create_task(turn(hold=True))
    await in_turn.wait()
    async with versions.syncing(4):
        pass
    await turn(hold=False)  # starts after the sync, while the first is still in flight
    end_turn.set()
    await first
    assert seen == [3, 4] and versions.version == 4
    # busy from the first turn's start (tick 0) to its end (tick 1); snapshot reads tick 2 (nothing runs)
    assert versions.snapshot().busy_s == 1.0

    async def failing():
        async with versions.syncing(5):
            raise RuntimeError("weights did not load")

    with pytest.raises(RuntimeError):
        await failing()
    assert versions.version == 4  # a failed sync leaves the engines' version as it was


class _ScriptedEngine:
    """Plays fixed turns (token ids of `texts`): the test controls what the model says, the loop and
    the version gate are the real ones."""

    def __init__(self, tokenizer, texts: list[str]):
        self._turns = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        self.calls = 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        ids = self._turns[min(self.calls, len(self._turns) - 1)]
        self.calls += 1
        return Generation(list(ids), [-0.5] * len(ids), "stop")

    def capacity(self) -> KVCapacity:
        return KVCapacity(None, None)

    def load_weights(self, weights) -> None:
        pass

    async def close(self) -> None:
        pass


@session_loop
async def test_a_partial_rollout_keeps_each_tokens_version(tiny_model_dir):
    """A sync lands while the trajectory waits for its tool: turn 1 (and its tool response) keep
    version 0, turn 2 is generated with version 1."""
    from tirl.engines import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    engine = _ScriptedEngine(
        tokenizer, ['<tool_call>{"name": "hold", "arguments": {}}</tool_call>', "<answer>\\boxed{2}</answer>"]
    )
    Hold.entered, Hold.release = asyncio.Event(), asyncio.Event()
    cfg = AgentConfig(tools=["tests.rl.held_tool:Hold"], max_turns=3, max_response_tokens=200)
    versions = WeightVersions(0)
    pool = VersionedPool(SingleEnginePool(engine), versions)
    task = asyncio.create_task(
        run_trajectory(pool, tokenizer, None, Problem("p", "1+1?", "2"), cfg, group="p#0")
    )
    await Hold.entered.wait()
    async with versions.syncing(1):
        pass
    Hold.release.set()
    traj = await task
    assert traj.turns == 2 and traj.finish_reason == "answered", traj.error
    assert len(traj.versions) == len(traj.response_ids) == len(traj.loss_mask)
    first_turn = len(engine._turns[0])
    tool = traj.loss_mask.index(1, first_turn) - first_turn  # the tool response's tokens
    assert traj.versions == [0] * (first_turn + tool) + [1] * len(engine._turns[1])
    assert traj.oldest_version == 0


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def runtime(tiny_model_dir):
    engine = EngineConfig(backend="hf", device="cpu", model=str(tiny_model_dir), max_model_len=1024)
    async with open_runtime(
        ClusterConfig(), engine, SandboxConfig(mode="inprocess", slots=1), RewardConfig(workers=1)
    ) as rt:
        yield rt


def _producer(rt, versions, alg: AlgorithmConfig, steps: int, seed: int = 3) -> GroupProducer:
    return GroupProducer(
        rt,
        versions,
        PROBLEMS,
        EpochSampler(len(PROBLEMS), seed),
        AGENT,
        lambda group, s: roc_select(group, alg, s),
        prompts_per_step=alg.prompts_per_step,
        rollouts_per_prompt=alg.rollouts_per_prompt,
        max_staleness=alg.staleness_bound,
        seed=seed,
        first_step=0,
        steps=steps,
    )


@session_loop
async def test_streamed_step_equals_generate_then_score_then_roc(runtime):
    """The synchronous step through the producer (each trajectory scored as it ends, RoC per group as it
    completes) trains on exactly what generate -> score -> RoC of the same prompts and seeds gives."""
    alg = AlgorithmConfig(prompts_per_step=2, group_size=2)
    versions = WeightVersions(0)
    producer = _producer(runtime, versions, alg, steps=1)
    try:
        step = await producer.take(0)
    finally:
        await producer.close()
    batch = [PROBLEMS[i] for i in EpochSampler(len(PROBLEMS), 3).next(2)]
    assert [p.id for p in step.problems] == [p.id for p in batch]
    groups = await generate_scored(
        runtime, batch, alg.rollouts_per_prompt, AGENT, seed=derive_seed(3, 0), concurrency=256
    )
    kept = [roc_select(g, alg, derive_seed(3, 0, i)) for i, g in enumerate(groups)]
    assert step.kept == kept
    for got, want in zip(step.groups, groups, strict=True):
        for a, b in zip(got, want, strict=True):
            assert (a.problem_id, a.sample_index, a.response_ids, a.loss_mask) == (
                b.problem_id,
                b.sample_index,
                b.response_ids,
                b.loss_mask,
            )
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5) and a.reward == b.reward
            assert set(a.versions) == {0}
    assert step.metrics["async/staleness/0"] == 2 and step.metrics["async/dropped_stale"] == 0


class _HeldPool:
    """The runtime's pool, with the lease of one named trajectory held until the test releases it (the
    slow member of a group: everything else about the rollout is real)."""

    def __init__(self, pool, group: str, member: int):
        self.pool, self.group, self.member = pool, group, member
        self.leases: dict[str, int] = {}
        self.held, self.release = asyncio.Event(), asyncio.Event()

    @asynccontextmanager
    async def lease(self, group: str, max_tokens: int):
        n = self.leases[group] = self.leases.get(group, 0) + 1
        if group == self.group and n == self.member + 1:
            self.held.set()
            await self.release.wait()
        async with self.pool.lease(group, max_tokens) as engine:
            yield engine


@session_loop
async def test_a_stale_group_is_dropped_and_its_prompt_trained_later(runtime):
    """k = 1, one prompt per step, 2 rollouts per prompt. Draw 0's second member is held back after its
    first finished at version 0; when the trainer reaches version 2 the group is 2 versions stale:
    dropped (counted), its prompt re-queued with fresh seeds, and trained in a later step. No trained
    token is ever more than k versions behind the trainer."""
    alg = AlgorithmConfig(prompts_per_step=1, group_size=1, oversample=2, max_staleness=1, **{"async": True})
    versions = WeightVersions(0)
    held = _HeldPool(runtime.pool, "", member=1)
    original, runtime.pool = runtime.pool, held
    producer = _producer(runtime, versions, alg, steps=6)
    first = PROBLEMS[EpochSampler(len(PROBLEMS), 3).next(1)[0]]
    held.group = f"{first.id}#0"
    metrics, trained = [], []
    try:
        for version in range(6):
            step = await producer.take(version)
            metrics.append(step.metrics)
            trained.append(step.problems[0].id)
            for t in step.groups[0]:
                assert version - min(t.versions) <= 1 and t.versions == sorted(t.versions)
            async with versions.syncing(version + 1):
                pass
            producer.synced(version + 1)
    finally:
        held.release.set()
        await producer.close()
        runtime.pool = original
    assert held.held.is_set()
    assert trained[0] != first.id and trained[1] != first.id  # draw 0 was never complete in time
    assert sum(m["async/dropped_stale"] for m in metrics) == 1
    assert metrics[2]["async/dropped_stale"] == 1  # counted at the first take after the drop
    retried = [i for i, m in enumerate(metrics) if m["async/retries_trained"]]
    assert len(retried) == 1 and trained[retried[0]] == first.id  # the re-queued prompt was trained
    assert all(sum(v for k, v in m.items() if k.startswith("async/staleness/")) == 1 for m in metrics)


def test_async_config_is_checked():
    assert AlgorithmConfig().staleness_bound == 0  # synchronous by default (the paper)
    assert AlgorithmConfig(max_staleness=3).staleness_bound == 0  # the bound only applies to async
    assert AlgorithmConfig(**{"async": True, "max_staleness": 3}).staleness_bound == 3
    with pytest.raises(ValidationError):
        AlgorithmConfig(max_staleness=-1)
    stages = [{"steps": 1, "data": "x"}]
    with pytest.raises(ValidationError, match="cannot sleep"):
        TrainConfig(model="m", stages=stages, algorithm={"async": True}, engine={"enable_sleep_mode": True})


# ---- the producer with a fake agent loop (no model, no tokenizer): admission up to (k + 1) * P, seeds,
# first complete first taken, staleness dropped only above k, retries waited for at k, metrics, failures,
# the exact mode's batches and sync barrier, the state a checkpoint stores and resumes from ----

FAKE_LOOP = pytest.mark.timeout(60)  # nothing real runs: a minute is a hang
FAKE_PROBLEMS = [Problem(f"p{i}", f"q{i}", str(i)) for i in range(8)]
FAKE_AGENT = AgentConfig(max_turns=2, max_response_tokens=64)


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
        return [1.0 if turns == [ref] else 0.0 for turns, ref in pairs]  # the model's own turns


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
        traj = Trajectory(problem.id, [1], sample_index=sample_index, model_turns=[problem.answer])
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
        FAKE_PROBLEMS,
        EpochSampler(len(FAKE_PROBLEMS), 11),
        FAKE_AGENT,
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


@FAKE_LOOP
@pytest.mark.parametrize(
    ("k", "steps", "steps_done", "admitted"),
    [(1, 5, 0, 4), (0, 5, 0, 2), (2, 5, 0, 6), (1, 1, 0, 2), (1, 5, 4, 2), (3, 5, 3, 4), (1, 5, 5, 0)],
)
async def test_admission_is_k_plus_one_steps_ahead_and_never_past_the_stage(
    env, k, steps, steps_done, admitted
):
    p = producer(env, max_staleness=k, steps=steps, steps_done=steps_done)
    order = EpochSampler(len(FAKE_PROBLEMS), 11).next(admitted)
    assert pending(p) == [[problem, i, False] for i, problem in enumerate(order)]
    assert p.state_dict()["next_index"] == admitted
    await p.close()


@FAKE_LOOP
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


@FAKE_LOOP
async def test_seeds_follow_batch_and_slot_and_every_trajectory_is_scored(env):
    p = producer(env, seed=3, first_step=10)
    got = await p.take(0)
    calls = sorted(env.calls)
    order = EpochSampler(len(FAKE_PROBLEMS), 11).next(4)
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
        assert all(t.reward == 1.0 for t in group)  # the scorer's verdict: the model's turn == the reference
    assert [pr.id for pr in got.problems] == [f"p{order[0]}", f"p{order[1]}"]
    await p.close()


@FAKE_LOOP
async def test_the_first_complete_groups_are_taken_and_handed_over_in_draw_order(env):
    wv = WeightVersions(0)
    for d in (0, 1):
        env.hold(d)
    env.hold(2)
    p = producer(env, wv)
    order = EpochSampler(len(FAKE_PROBLEMS), 11).next(4)
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


@FAKE_LOOP
async def test_staleness_at_exactly_k_is_kept_and_above_k_dropped_and_requeued_first(env):
    wv = WeightVersions(0)
    env.hold(0)  # draw 0's turn starts at version 0 and does not end
    p = producer(env, wv, prompts_per_step=1, max_staleness=1, steps=6)
    order = EpochSampler(len(FAKE_PROBLEMS), 11).next(6)
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


@FAKE_LOOP
async def test_a_dropped_group_is_requeued_before_new_draws_and_its_retry_trained(env):
    wv = WeightVersions(0)
    env.hold(0)
    p = producer(env, wv, prompts_per_step=1, max_staleness=0, steps=6)
    order = EpochSampler(len(FAKE_PROBLEMS), 11).next(6)
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


@FAKE_LOOP
async def test_a_retry_due_at_k_is_waited_for_even_when_others_are_complete(env):
    wv = WeightVersions(0)
    env.hold(0)
    p = producer(env, wv, prompts_per_step=1, max_staleness=1, steps=8)
    order = EpochSampler(len(FAKE_PROBLEMS), 11).next(8)
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


@FAKE_LOOP
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


@FAKE_LOOP
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


@FAKE_LOOP
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


@FAKE_LOOP
async def test_dropped_count_is_reported_once(env):
    p = producer(env, max_staleness=0, prompts_per_step=1, steps=3)
    p._dropped = 3
    g = await p.take(0)
    assert g.metrics["async/dropped_stale"] == 3
    assert p._metrics([], 0)["async/dropped_stale"] == 0
    await p.close()


@FAKE_LOOP
async def test_a_failed_trajectory_fails_the_step(env):
    env.fail.add(1)
    p = producer(env)
    with pytest.raises(RuntimeError, match="draw 1 failed"):
        await p.take(0)
    await p.close()


@FAKE_LOOP
async def test_state_dict_and_resume_from_it(env):
    p = producer(
        env,
        prompts_per_step=1,
        max_staleness=2,
        steps=9,
        state={"pending": [[5, 7, True], [1, 8, False]], "next_index": 9},
    )
    new = EpochSampler(len(FAKE_PROBLEMS), 11).next(1)[0]
    assert p.state_dict() == {"pending": [[5, 7, True], [1, 8, False], [new, 9, False]], "next_index": 10}
    await settle()
    assert sorted(c[0] for c in env.calls) == sorted(["p5#7"] * 2 + ["p1#8"] * 2 + [f"p{new}#9"] * 2)
    await p.close()
    assert p.state_dict() == {"pending": [], "next_index": 10}


@FAKE_LOOP
async def test_queued_draws_beyond_the_room_stay_in_the_state(env):
    state = {"pending": [[1, 3, False], [2, 4, False], [3, 5, True]], "next_index": 6}
    p = producer(env, prompts_per_step=1, max_staleness=0, steps=9, state=state)
    assert p.state_dict() == {"pending": [[1, 3, False], [2, 4, False], [3, 5, True]], "next_index": 6}
    assert len(p._groups) == 1
    await p.close()


@FAKE_LOOP
async def test_close_cancels_the_groups_in_flight(env):
    env.hold(0)
    p = producer(env)
    await settle()
    tasks = [g.task for g in p._groups.values()]
    await p.close()
    assert tasks[0].cancelled() and all(t.done() for t in tasks)


@FAKE_LOOP
async def test_exact_mode_takes_its_own_batch_and_holds_syncs_until_all_admitted_are_done(env):
    wv = WeightVersions(0)
    env.hold(3)
    p = producer(env, wv, exact=True, prompts_per_step=2, max_staleness=1, steps=4)
    order = EpochSampler(len(FAKE_PROBLEMS), 11).next(4)
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


@FAKE_LOOP
async def test_exact_mode_never_drops(env):
    wv = WeightVersions(0)
    p = producer(env, wv, exact=True, prompts_per_step=1, max_staleness=0, steps=3)
    await settle()
    p._groups[0].span.record(0)
    p._drop_stale(5)
    assert 0 in p._groups and p._dropped == 0
    await p.close()


@FAKE_LOOP
async def test_exact_mode_says_when_a_batch_was_never_admitted(env):
    p = producer(env, exact=True, prompts_per_step=2, max_staleness=0, steps=4, steps_done=1)
    with pytest.raises(RuntimeError) as err:
        await p.take(0)
    assert str(err.value) == "exact staleness: 2 group(s) of batch 1 were never admitted"
    await p.close()


@FAKE_LOOP
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


@FAKE_LOOP
async def test_a_failure_of_the_last_group_in_flight_is_raised_not_waited_on(env):
    env.fail.add(0)
    p = producer(env, exact=True, prompts_per_step=1, max_staleness=0, steps=2)
    try:
        with pytest.raises(RuntimeError, match="draw 0 failed"):
            await asyncio.wait_for(p.all_done(), 2)
    finally:
        await p.close()


@FAKE_LOOP
async def test_groups_are_taken_in_completion_order_not_admission_order(env):
    for d in range(4):
        env.hold(d)
    p = producer(env, prompts_per_step=2, max_staleness=1, steps=5)
    order = EpochSampler(len(FAKE_PROBLEMS), 11).next(4)
    await settle()
    for d in (3, 2, 0):  # complete in this order: 3 and 2 first
        env.hold(d).set()
        await settle()
    got = await p.take(0)
    assert [pr.id for pr in got.problems] == [f"p{order[2]}", f"p{order[3]}"]  # handed over in draw order
    env.hold(1).set()
    await p.close()


@FAKE_LOOP
async def test_the_agent_loop_gets_the_runtimes_tokenizer_and_executor_and_each_trajectory_is_seen(env):
    tokenizer, executor = object(), object()
    p = producer(env, runtime=Runtime(GatePool(env), tokenizer, executor), steps=1)
    got = await p.take(0)
    assert env.passed and all(x == (tokenizer, executor, FAKE_AGENT) for x in env.passed)
    assert sorted(map(id, env.seen)) == sorted(id(t) for g in got.groups for t in g)
    await p.close()


@FAKE_LOOP
async def test_exact_mode_waits_for_its_whole_batch_and_moves_through_every_batch(env):
    wv = WeightVersions(0)
    env.hold(0)
    p = producer(env, wv, exact=True, prompts_per_step=1, max_staleness=0, steps=3)
    order = EpochSampler(len(FAKE_PROBLEMS), 11).next(3)
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


@FAKE_LOOP
async def test_two_takes_before_a_sync_both_hold_their_room(env):
    p = producer(env, prompts_per_step=1, max_staleness=1, steps=5)
    first = await p.take(0)
    second = await p.take(0)  # a trainer taking the next step's groups before syncing
    assert len(first.groups) == len(second.groups) == 1
    assert p.room() == 0 and pending(p) == []  # both steps' groups count until the sync
    p.synced(1)
    assert [d[1] for d in pending(p)] == [2, 3]
    await p.close()


@FAKE_LOOP
async def test_exact_mode_counts_the_missing_groups_of_a_partly_admitted_batch(env):
    # resumed with draw 2 of batch 1 pending; the other admitted draw is new (index 5): draw 3 is missing
    state = {"pending": [[0, 2, False]], "next_index": 5}
    p = producer(env, exact=True, prompts_per_step=2, max_staleness=0, steps=4, steps_done=1, state=state)
    assert [d[1] for d in pending(p)] == [2, 5]
    with pytest.raises(RuntimeError) as err:
        await p.take(1)
    assert str(err.value) == "exact staleness: 1 group(s) of batch 1 were never admitted"
    await p.close()
