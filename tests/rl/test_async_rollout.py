"""Streaming and asynchronous rollouts: the weight-sync gate, per-token policy versions across a sync
(partial rollouts), the group producer against today's generate-then-score step, and the staleness
bound (a stale group dropped, its prompt re-queued and trained later). Real tiny model on the HF
engine, real sandbox and math-verify; tests wait on events, never on time."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import pytest
import pytest_asyncio
from pydantic import ValidationError
from tests.rl.held_tool import Hold

from tirl.agent.config import AgentConfig
from tirl.agent.loop import run_trajectory
from tirl.data.problem import Problem
from tirl.engines.base import Generation, KVCapacity, SamplingParams, SingleEnginePool
from tirl.engines.config import EngineConfig
from tirl.engines.versions import VersionedPool, WeightVersions
from tirl.reward import RewardConfig
from tirl.rl.async_rollout import GroupProducer
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
