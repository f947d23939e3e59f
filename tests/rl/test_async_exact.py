"""Which weights really generated each trained token, in both staleness modes, with a scripted engine whose
"weights" are a version number (each token's log-prob is minus the version the engine held when it decoded
that token), the real agent loop, version gate and group producer, and no model: fast.

- bounded: a sync that lands mid-generation (the engine blocked inside a turn until the sync) leaves the
  turn stamped with the version it started with (a lower bound), while the engine log-probs, which TIS
  weighs against, are the true behaviour policy's, token by token.
- exact: the sync waits for the groups ahead; step t trains on version max(t - k, 0) exactly, and two
  runs with one seed (and different timings) train on the same prompts with the same versions.
"""

from __future__ import annotations

import asyncio
import random
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from tirl.agent.config import AgentConfig
from tirl.data.problem import Problem
from tirl.engines.base import Generation, KVCapacity, SamplingParams
from tirl.engines.versions import WeightVersions
from tirl.rl.async_rollout import GroupProducer
from tirl.rl.sampler import EpochSampler

pytestmark = pytest.mark.timeout(120)

PROBLEMS = [Problem(f"p{i}", f"What is {i} + {i}?", str(2 * i)) for i in range(8)]
AGENT = AgentConfig(max_turns=2, max_response_tokens=64)
ANSWER = "<answer>\\boxed{2}</answer>"


class WeightsEngine:
    """Decodes a fixed answer token by token; each token's log-prob is -(the version it was decoded with).
    `pauses[draw]`: members of that draw block after their first token until the event is set."""

    def __init__(self, tokenizer, rng: random.Random | None = None):
        self.ids = tokenizer.encode(ANSWER, add_special_tokens=False)
        self.weights = 0
        self.rng = rng
        self.pauses: dict[int, asyncio.Event] = {}
        self.paused: dict[int, int] = {}

    async def generate(self, prompt_ids: list[int], params: SamplingParams, draw: int = -1) -> Generation:
        logprobs = []
        for i in range(len(self.ids)):
            if i == 1 and draw in self.pauses:
                self.paused[draw] = self.paused.get(draw, 0) + 1
                await self.pauses[draw].wait()
            # another interleaving every run: only the exact mode's pattern may not depend on it
            await asyncio.sleep(self.rng.random() * 2e-3 if self.rng else 0)
            logprobs.append(-float(self.weights))
        return Generation(list(self.ids), logprobs, "stop")


class _Lease:
    """The engine as one draw's lease sees it (so a test can block one draw's turns)."""

    def __init__(self, engine: WeightsEngine, draw: int):
        self.engine, self.draw, self.name = engine, draw, "weights"

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        return await self.engine.generate(prompt_ids, params, self.draw)

    def capacity(self) -> KVCapacity:
        return KVCapacity(None, None)


class _Pool:
    def __init__(self, engine: WeightsEngine):
        self.engine = engine

    @asynccontextmanager
    async def lease(self, group: str, max_tokens: int):
        yield _Lease(
            self.engine, int(group.rsplit("#", 1)[1])
        )  # the test's own lease key, not the producer's


class _Scorer:
    async def score_many(self, pairs: list[tuple[str, str]]) -> list[float]:
        return [1.0 for _ in pairs]


@dataclass
class _Runtime:
    pool: _Pool
    tokenizer: object
    executor: None = None
    scorer: _Scorer = field(default_factory=_Scorer)


def _producer(engine, tokenizer, versions, *, k: int, exact: bool, steps: int, p: int = 2, n: int = 2):
    return GroupProducer(
        _Runtime(_Pool(engine), tokenizer),
        versions,
        PROBLEMS,
        EpochSampler(len(PROBLEMS), 7),
        AGENT,
        lambda group, seed: list(range(len(group))),
        prompts_per_step=p,
        rollouts_per_prompt=n,
        max_staleness=k,
        seed=7,
        first_step=0,
        steps=steps,
        exact=exact,
    )


async def _sync(versions: WeightVersions, engine: WeightsEngine, version: int) -> None:
    async with versions.syncing(version):
        engine.weights = version  # the engines load the new weights


def _true_versions(traj) -> list[int]:
    """The version that decoded each generated token, read from the scripted log-probs."""
    return [round(-lp) for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m]


def _stamps(traj) -> list[int]:
    return [v for v, m in zip(traj.versions, traj.loss_mask, strict=True) if m]


async def _train(
    tokenizer, *, k: int, steps: int, timing: int
) -> list[list[tuple[str, list[int], list[int]]]]:
    """Drive the exact mode like the trainer (take, update while the engines run ahead, sync, synced);
    per step, each trained trajectory's problem, stamped versions and true versions."""
    rng = random.Random(timing)
    engine = WeightsEngine(tokenizer, rng)
    versions = WeightVersions(0)
    producer = _producer(engine, tokenizer, versions, k=k, exact=True, steps=steps)
    seen = []
    try:
        for t in range(steps):
            batch = await producer.take(t)
            assert batch.metrics["async/dropped_stale"] == 0
            seen.append(
                [
                    (p.id, _stamps(tr), _true_versions(tr))
                    for p, g in zip(batch.problems, batch.groups, strict=True)
                    for tr in g
                ]
            )
            await asyncio.sleep(rng.random() * 5e-3)  # the update, while the engines generate ahead
            await _sync(versions, engine, t + 1)
            producer.synced(t + 1)
    finally:
        await producer.close()
    return seen


@pytest.mark.parametrize("k", [1, 2])
async def test_exact_mode_trains_step_t_on_version_t_minus_k(tokenizer, k):
    steps = 6
    runs = [await _train(tokenizer, k=k, steps=steps, timing=timing) for timing in (1, 2)]
    for t, trained in enumerate(runs[0]):
        want = max(t - k, 0)
        assert len(trained) == 2 * 2  # P groups x n rollouts
        for _, stamps, truth in trained:
            assert set(stamps) == {want} and set(truth) == {want}, (t, stamps, truth)
    assert runs[0] == runs[1]  # one seed, two timings: the same prompts, versions and tokens every step
    order = [p.id for p in (PROBLEMS[i] for i in EpochSampler(len(PROBLEMS), 7).next(2 * steps))]
    assert [pid for step in runs[0] for pid, _, _ in step[::2]] == order  # batch t = draws of step t


async def test_exact_mode_sync_waits_for_the_groups_ahead(tokenizer):
    """k = 1: while step 0 trains, draw 1 (batch 1) is blocked mid-turn; the sync to version 1 waits for
    it, so batch 1 is generated by version 0 alone."""
    engine = WeightsEngine(tokenizer)
    hold = engine.pauses[1] = asyncio.Event()
    versions = WeightVersions(0)
    producer = _producer(engine, tokenizer, versions, k=1, exact=True, steps=3, p=1)
    try:
        await producer.take(0)
        sync = asyncio.create_task(_sync(versions, engine, 1))
        for _ in range(50):
            await asyncio.sleep(0)
        assert engine.paused.get(1) == 2 and not sync.done() and engine.weights == 0
        hold.set()
        await sync
        producer.synced(1)
        step1 = await producer.take(1)
    finally:
        hold.set()
        await producer.close()
    assert [_true_versions(t) for t in step1.groups[0]] == [[0] * len(engine.ids)] * 2
    assert step1.metrics["async/staleness/1"] == 1


async def test_a_sync_mid_generation_keeps_the_start_version_and_the_true_logprobs(tokenizer):
    """Bounded mode, k = 1: draw 1's members are blocked inside their turn when the sync to version 1
    lands. Their tokens are stamped 0 (the turn's start: a lower bound), the group counts 1 version stale,
    and the engine log-probs say which weights really decoded each token (0 for the first, 1 after)."""
    engine = WeightsEngine(tokenizer)
    holds = {d: engine.pauses.setdefault(d, asyncio.Event()) for d in (1, 2)}
    versions = WeightVersions(0)
    producer = _producer(engine, tokenizer, versions, k=1, exact=False, steps=3, p=1)
    try:
        step0 = await producer.take(0)
        while engine.paused.get(1, 0) < 2:
            await asyncio.sleep(0)
        await _sync(versions, engine, 1)  # lands while draw 1 is mid-turn: nothing waits in this mode
        producer.synced(1)  # admits draw 2 (held too, so draw 1 is the one to complete)
        holds[1].set()
        step1 = await producer.take(1)
    finally:
        for h in holds.values():
            h.set()
        await producer.close()
    n = len(engine.ids)
    assert [_true_versions(t) for t in step0.groups[0]] == [[0] * n] * 2
    for t in step1.groups[0]:
        assert _stamps(t) == [0] * n  # stamped with the turn's start version
        assert _true_versions(t) == [0] + [1] * (n - 1)  # what TIS weighs against: the truth per token
        assert t.oldest_version == 0
    assert step1.metrics["async/staleness/1"] == 1
    assert step1.metrics["async/behaviour_version_min"] == 0 == step1.metrics["async/behaviour_version_max"]
