"""The runtime seam: what `tirl train`, `tirl eval`, `tirl chat` and `tirl data filter-hard` need to
turn problems into scored trajectories, whatever runs where.

    async with open_runtime(cluster, engine, sandbox, reward) as rt:
        groups = await generate_scored(rt, problems, n=8, agent_cfg=agent, seed=0, concurrency=64)

`Runtime` holds engines behind the scheduler (`pool`), a sandbox executor, a reward scorer and the
tokenizer. `local` (tirl.runtime.local) builds them in this process tree; `ray`
(tirl.runtime.ray) places engine actors, sandbox services and reward workers across nodes and
hands back proxies with the same interfaces, so the callers never know which one they got.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from tirl.distributed.weight_sync import Source, gathered
from tirl.engines.base import Engine, EnginePool, FlatLoader, StagedWake
from tirl.engines.handoff import flat_handoff, flat_layout, pack_flat
from tirl.engines.scheduler import RolloutScheduler
from tirl.sandbox.result import Executor

T = TypeVar("T")

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tirl.agent.config import AgentConfig
    from tirl.agent.trajectory import Trajectory
    from tirl.data.problem import Problem
    from tirl.reward import RewardStats


class SyncFleet(Protocol):
    """Engines in processes of their own that a sync reaches over a process group with trainer rank 0
    (tirl.runtime.ray.ActorFleet): who takes part in the next sync, and who came back by it."""

    def sync_targets(self) -> list[Any]: ...

    def synced(self, members: list[Any]) -> None: ...


class Scorer(Protocol):
    """Binary answer-only reward (tirl.reward.RewardPool, or a proxy to one on another node)."""

    stats: RewardStats

    async def score_many(self, pairs: list[tuple[str | Sequence[str], str]]) -> list[float]: ...

    async def equivalent(self, answer: str, reference: str) -> bool: ...


@dataclass
class Runtime:
    engines: list[Engine]
    pool: EnginePool  # the KV-aware scheduler over `engines` (or the one engine)
    executor: Executor  # the sandbox: async run(code, stdin, timeout) -> ExecResult
    scorer: Scorer | None  # None when the caller asked for no reward (tirl chat)
    tokenizer: PreTrainedTokenizerBase
    backend: str = "local"
    counters: dict[str, int] = field(default_factory=dict)  # infrastructure events (engine restarts, ...)
    fleet: SyncFleet | None = None  # engines reached over a sync group (ray; tirl.runtime.handoff picks it)

    def load_sources(self, sources: dict[str, Source], device: torch.device) -> dict[str, float]:
        """One sync from the trainer in this process (`sources` gathered one at a time: under FSDP a
        collective every rank runs in this order). Engines that open a packed sync get one flat buffer
        in their dtype (tirl.engines.handoff), packed once; others get (name, tensor) pairs."""
        return load_sources(self.engines, sources, device)

    def sleep(self, discard_weights: bool = False) -> int:
        """Engines that share devices with the trainer free their memory while it trains, where their
        backend can (vLLM sleep mode with engine.enable_sleep_mode, the HF engine on a GPU), all at
        once; the number that did. An engine on CPU has nothing to free and says so (False).
        `discard_weights`: a sync rewrites every weight before the next generation, so engines that
        can (vLLM) keep no copy of the old ones."""

        def one(engine: Engine) -> bool:
            if discard_weights and isinstance(engine, StagedWake):
                return bool(engine.sleep(discard_weights=True))
            return bool(engine.sleep())

        return sum(_concurrently([lambda e=e: one(e) for e in self.engines]))

    def wake_weights(self) -> None:
        """Before a sync: the weights' memory back, not the KV cache's (the trainer still holds its
        parameters). Engines without the two-phase wake wake whole at `wake_up`."""
        _concurrently([e.wake_weights for e in self.engines if isinstance(e, StagedWake)])

    def wake_up(self) -> None:
        """Everything still asleep (the KV cache, after the trainer let go of its memory), all at once."""
        _concurrently([e.wake_up for e in self.engines])

    def engine_metrics(self) -> dict[str, Any]:
        """The scheduler's window since the last call, per engine (trajectories leased, busy and idle time,
        peak in flight, KV usage, preemptions), and the infrastructure counters."""
        out: dict[str, Any] = {f"infra/{k}": v for k, v in self.counters.items()}
        if isinstance(self.pool, RolloutScheduler):
            m = self.pool.metrics()
            out["rollout/makespan_s"], out["rollout/preemptions"] = m["makespan_s"], m["preemptions"]
            for e in m["engines"]:
                for key in ("leases", "busy_s", "idle_s", "peak_in_flight", "kv_usage", "preemptions"):
                    out[f"rollout/{key}/{e['engine']}"] = e[key]
            self.pool.reset_metrics()
        return out


def load_sources(engines: list[Engine], sources: dict[str, Source], device: torch.device) -> dict[str, float]:
    """`Runtime.load_sources` for these engines (also for a caller with engines but no runtime)."""
    flat = [e for e in engines if isinstance(e, FlatLoader)]
    if not flat or len(flat) < len(engines) or len({e.dtype for e in flat}) > 1:
        pairs = [(name, gathered(source).detach().cpu()) for name, source in sources.items()]
        _concurrently([lambda e=e: e.load_weights(pairs) for e in engines])
        nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
        return {"sync/tensors": float(len(pairs)), "sync/bytes": float(nbytes), "sync/buffers": 0.0}
    return _hand_off(flat, sources, device)


def _hand_off(
    engines: list[FlatLoader], sources: dict[str, Source], device: torch.device
) -> dict[str, float]:
    """The sync packed once in the engines' dtype: into `device`'s memory when an engine shares that GPU
    (it opens the buffer by CUDA IPC, no host copy), and into one shared host file for all the others
    (copied once from the GPU buffer, or packed there directly when no engine shares the GPU)."""
    entries = [(name, tuple(s.shape), s.dtype) for name, s in sources.items()]
    plan, nbytes = flat_layout(entries, engines[0].dtype)
    near = [e for e in engines if e.near(device)]
    far = [e for e in engines if not e.near(device)]
    host = torch.device("cpu")
    with ExitStack() as stack:
        first = stack.enter_context(flat_handoff(plan, nbytes, device if near else host))
        pack_flat(((name, gathered(source)) for name, source in sources.items()), plan, first.buf)
        shared, buffers = first, [first]
        if far and first.path is None:
            shared = stack.enter_context(flat_handoff(plan, nbytes, host))
            shared.buf.copy_(first.buf)
            buffers.append(shared)
        _concurrently([lambda e=e: e.load_flat(first if e in near else shared) for e in engines])
    return {
        "sync/tensors": float(len(plan)),
        "sync/bytes": float(nbytes),
        "sync/buffers": float(len(buffers)),
        "sync/host_bytes": float(sum(b.nbytes for b in buffers if b.path is not None)),
    }


def _concurrently(calls: list[Callable[[], T]]) -> list[T]:
    """Blocking engine calls (each waits on its own process or actor) run side by side: n engines
    sleep or wake in the time of one, not n."""
    if len(calls) <= 1:
        return [call() for call in calls]
    with ThreadPoolExecutor(len(calls), thread_name_prefix="tirl-engines") as pool:
        return list(pool.map(lambda call: call(), calls))


async def generate(
    rt: Runtime,
    problems: list[Problem],
    n: int,
    agent_cfg: AgentConfig,
    seed: int,
    concurrency: int,
    on_done: Callable[[Trajectory], None] | None = None,
) -> list[list[Trajectory]]:
    """n trajectories per problem; sample j of problem i is seeded by (seed, i, j)."""
    from tirl.agent.loop import rollout

    return await rollout(
        rt.pool,
        rt.tokenizer,
        rt.executor,
        problems,
        n,
        agent_cfg,
        seed=seed,
        concurrency=concurrency,
        on_done=on_done,
    )


async def score_trajectory(scorer: Scorer, trajectory: Trajectory, reference: str) -> float:
    """One trajectory's binary, answer-only reward: 0 for one that is not scored (truncated at the length
    budget, as in the paper, or ended by an infrastructure error: Trajectory.scored), else the verifier's
    on the model's own turns (tool output never answers for the model: tirl.reward.extract)."""
    if not trajectory.scored:
        return 0.0
    [reward] = await scorer.score_many([(trajectory.model_turns, reference)])
    return float(reward)


async def generate_scored(
    rt: Runtime,
    problems: list[Problem],
    n: int,
    agent_cfg: AgentConfig,
    seed: int,
    concurrency: int,
    on_scored: Callable[[Trajectory], None] | None = None,
) -> list[list[Trajectory]]:
    """The one roll-out-then-score path (eval, the hard-problem filter; training streams the same two
    calls per trajectory, tirl.rl.async_rollout): n trajectories per problem, each scored the moment it
    ends, so verification overlaps the rollouts still running. `on_scored` sees each one with its reward."""
    if rt.scorer is None:
        raise RuntimeError("this runtime was opened without a reward config: it cannot score")
    references = {p.id: p.answer for p in problems}
    if len(references) != len(problems):
        raise ValueError("generate_scored needs unique problem ids: trajectories are matched by them")
    pending: list[asyncio.Task[None]] = []

    async def finish(trajectory: Trajectory) -> None:
        trajectory.reward = await score_trajectory(rt.scorer, trajectory, references[trajectory.problem_id])
        if on_scored is not None:
            on_scored(trajectory)

    try:
        groups = await generate(
            rt,
            problems,
            n,
            agent_cfg,
            seed,
            concurrency,
            on_done=lambda t: pending.append(asyncio.ensure_future(finish(t))),
        )
        await asyncio.gather(*pending)
    finally:
        for task in pending:
            task.cancel()
    return groups
