"""The rollout groups of the RL steps, streamed, and generated ahead of the trainer under a staleness bound.

`GroupProducer` turns the stage's prompt stream into scored, RoC-selected groups:
- streaming (in every mode): each trajectory is scored the moment it ends (the reward pool verifies
  while the rest still generate), and a group goes through RoC the moment its 2G members are done;
  a step trains on complete groups only.
- admission: prompts are drawn from the sampler one group at a time, while fewer than (k + 1) * P
  groups are admitted and not yet trained on (P = prompts_per_step, k = `max_staleness` with
  `algorithm.async`, else 0), and never more than the stage's remaining steps need. With k = 0 the next
  step's prompts are admitted only after the weight sync, so the step is exactly the synchronous one
  (same prompts, seeds and weights); with k > 0 the engines generate up to k steps ahead while the
  trainer updates, and weights are synced into them while trajectories are in flight
  (tirl.engines.versions): a trajectory continues under the new weights, its turns keeping the
  versions they were generated with.
- taking a step: `take(version)` waits for P complete groups (first complete, first taken) and hands
  them over in draw order. A group whose oldest token is more than k versions behind the trainer is
  never trained on: it is dropped (counted) and its prompt re-queued at the front with fresh seeds.
- starvation: a re-queued prompt's second attempt is never dropped: once its oldest token is k versions
  behind, the trainer waits for it and takes it in that step (at staleness exactly k). So a hard, slow
  problem costs at most one wasted attempt and one wait, and is never silently skipped; the bias
  towards fast (short, often easy) groups is bounded by that one retry.

Exact staleness (`exact=True`, `algorithm.staleness_mode: exact`), for tests and studies: step t trains
on the groups of batch t (draws t*P .. t*P + P - 1, in draw order, never the first complete), generated
entirely by policy version max(t - k, 0) of the stage. Admission is the same (k + 1 batches ahead),
but a weight sync first waits until every admitted group is done (`WeightVersions.hold_syncs`), so no
turn straddles a sync and nothing is ever dropped: the same staleness pattern in every run, so one seed
reproduces one curve. The price: the engines idle from the end of the batch ahead until the sync (the
bounded mode generates through it).

Seeds: draw number d of a stage (its admission counter) belongs to batch b = d // P, slot i = d % P;
trajectory j is seeded by (seed, first_step + b, i, j) and RoC by (seed, first_step + b, i), exactly
the synchronous trainer's (seed, step, i, j) when nothing is re-queued.

Resume (departure from systems that save in-flight state): a checkpoint stores the draws admitted and
not yet trained on (`state_dict`); their trajectories in flight are discarded and regenerated from the
same seeds at the checkpoint's weights on resume. With k = 0 that replays the uninterrupted run
exactly; with k > 0 the regenerated groups are fresher than the discarded ones would have been (as is
any async run's timing-dependent interleaving of versions).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tirl.agent.config import AgentConfig
from tirl.agent.loop import run_trajectory
from tirl.agent.trajectory import Trajectory
from tirl.data.problem import Problem
from tirl.engines.versions import VersionedPool, VersionSpan, WeightVersions
from tirl.rl.sampler import EpochSampler
from tirl.runtime.base import Runtime, score_trajectory
from tirl.seeds import derive_seed

Selector = Callable[[list[Trajectory], int], list[int]]  # (group, seed) -> kept indices (RoC)


@dataclass(frozen=True)
class Draw:
    problem: int  # index into the stage's problems
    index: int  # the stage's admission counter when drawn: its seeds
    retry: bool = False  # re-queued after a stale drop: never dropped again


@dataclass
class _Group:
    draw: Draw
    task: asyncio.Task | None = None
    span: VersionSpan = field(default_factory=VersionSpan)  # the versions its members' turns started with
    trajectories: list[Trajectory] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    done: bool = False
    done_at: int = 0  # completion order


@dataclass
class StepGroups:
    """What one RL step trains on: complete groups in draw order, with RoC's kept indices."""

    problems: list[Problem]
    groups: list[list[Trajectory]]
    kept: list[list[int]]
    metrics: dict[str, Any]


class GroupProducer:
    """One stage's stream of scored, RoC-selected groups (see the module docstring); rank 0 only.

    The trainer calls `take(version)` for each step's groups and `synced(version)` once the step's
    weights are in the engines; `state_dict()` goes into the checkpoint and back in as `state`.
    """

    def __init__(
        self,
        runtime: Runtime,
        versions: WeightVersions,
        problems: list[Problem],
        sampler: EpochSampler,
        agent: AgentConfig,
        select: Selector,
        *,
        prompts_per_step: int,
        rollouts_per_prompt: int,
        max_staleness: int,
        seed: int,
        first_step: int,
        steps: int,
        steps_done: int = 0,
        concurrency: int = 256,
        exact: bool = False,
        on_trajectory: Callable[[Trajectory], None] | None = None,
        state: dict | None = None,
    ):
        self.rt, self.versions, self.problems, self.sampler = runtime, versions, problems, sampler
        self.agent, self.select, self.on_trajectory = agent, select, on_trajectory
        self.P, self.n, self.k = prompts_per_step, rollouts_per_prompt, max_staleness
        self.seed, self.first_step, self.steps, self.steps_done = seed, first_step, steps, steps_done
        self.exact = exact
        self._gate = asyncio.Semaphore(concurrency)
        self._groups: dict[int, _Group] = {}  # admitted, not yet taken, by draw index (admission order)
        self._queue: deque[Draw] = deque()  # waiting for room: re-queued prompts (and resumed draws)
        self._next_index = 0
        self._unsynced = 0  # groups taken by the step whose weights are not synced yet
        self._dropped = 0  # stale groups dropped since the last take
        self._completed = 0
        self._changed = asyncio.Event()
        if state is not None:
            self._next_index = state["next_index"]
            self._queue.extend(Draw(*d) for d in state["pending"])
        if exact:
            versions.hold_syncs(self.all_done)
        self.fill()

    # --- admission --------------------------------------------------------------------------------
    def room(self) -> int:
        ahead = min(self.k + 1, self.steps - self.steps_done) * self.P
        return ahead - len(self._groups) - self._unsynced

    def fill(self) -> None:
        """Admit groups while there is room: queued (re-queued or resumed) draws first, then new ones."""
        while self.room() > 0:
            if self._queue:
                draw = self._queue.popleft()
            else:
                draw = Draw(self.sampler.next(1)[0], self._next_index)
                self._next_index += 1
            group = _Group(draw)
            self._groups[draw.index] = group
            group.task = asyncio.create_task(self._run(group))

    def _requeue(self, draw: Draw) -> Draw:
        retry = Draw(draw.problem, self._next_index, retry=True)
        self._next_index += 1
        return retry

    # --- one group --------------------------------------------------------------------------------
    def _seeds(self, draw: Draw) -> tuple[int, int]:
        batch, slot = divmod(draw.index, self.P)
        return self.first_step + batch, slot

    async def _run(self, group: _Group) -> None:
        try:
            await self._generate_group(group)
        finally:  # done or failed: either way take() and all_done() must look again (a failure is raised)
            self._changed.set()

    async def _generate_group(self, group: _Group) -> None:
        problem = self.problems[group.draw.problem]
        step, slot = self._seeds(group.draw)
        rollout_seed = derive_seed(self.seed, step)
        pool = VersionedPool(self.rt.pool, self.versions, group.span)
        members = [
            self._one(pool, problem, group.draw, j, derive_seed(rollout_seed, slot, j)) for j in range(self.n)
        ]
        group.trajectories = list(await asyncio.gather(*members))
        group.kept = self.select(group.trajectories, derive_seed(self.seed, step, slot))
        group.done, group.done_at = True, self._completed
        self._completed += 1

    async def _one(self, pool: VersionedPool, problem: Problem, draw: Draw, j: int, seed: int) -> Trajectory:
        async with self._gate:
            traj = await run_trajectory(
                pool,
                self.rt.tokenizer,
                self.rt.executor,
                problem,
                self.agent,
                group=f"{problem.id}#{draw.index}",
                sample_index=j,
                seed=seed,
            )
        if self.on_trajectory is not None:
            self.on_trajectory(traj)
        traj.reward = await score_trajectory(self.rt.scorer, traj, problem.answer)
        return traj

    # --- steps ------------------------------------------------------------------------------------
    def _drop_stale(self, version: int) -> None:
        """Drop the first attempts whose oldest token is more than k versions behind; re-queue them.
        (In the exact mode no group can be: each is generated by one version, k steps before its own.)"""
        if self.exact:  # a drop would re-queue a draw into a later batch: the pattern would not be exact
            return
        stale = [g for g in self._groups.values() if not g.draw.retry and g.span.behind(version) > self.k]
        for g in stale:
            del self._groups[g.draw.index]
            g.task.cancel()
        self._queue.extendleft(reversed([self._requeue(g.draw) for g in stale]))
        self._dropped += len(stale)

    def _raise_failed(self) -> None:
        for g in self._groups.values():
            if g.task.done() and not g.task.cancelled() and g.task.exception() is not None:
                raise g.task.exception()

    def _choose(self, version: int) -> list[_Group] | None:
        """P groups (retries about to go stale first, then first complete first), or None to wait."""
        if self.exact:
            return self._choose_batch()
        due = [
            g
            for g in self._groups.values()
            if g.draw.retry and g.span.oldest is not None and g.span.behind(version) >= self.k
        ]
        if not all(g.done for g in due):
            return None
        rest = sorted((g for g in self._groups.values() if g.done and g not in due), key=lambda g: g.done_at)
        chosen = due + rest[: max(0, self.P - len(due))]
        return chosen if len(chosen) >= self.P else None

    def _choose_batch(self) -> list[_Group] | None:
        """The exact mode's next batch: the P draws of this step's batch, once all are complete."""
        first = self.steps_done * self.P  # draw indices and steps_done count from the stage's start
        batch = [g for i, g in self._groups.items() if first <= i < first + self.P]
        if len(batch) < self.P:
            missing = self.P - len(batch)
            raise RuntimeError(
                f"exact staleness: {missing} group(s) of batch {self.steps_done} were never admitted"
            )
        return batch if all(g.done for g in batch) else None

    async def all_done(self) -> None:
        """Wait until no admitted group is generating (the exact mode's sync barrier)."""
        while not all(g.done for g in self._groups.values()):
            self._raise_failed()
            self._changed.clear()
            await self._changed.wait()
        self._raise_failed()

    async def take(self, version: int) -> StepGroups:
        """The next step's groups for a trainer at policy `version` (waits until they are complete)."""
        while True:
            self._drop_stale(version)
            self.fill()
            self._raise_failed()
            chosen = self._choose(version)
            if chosen is not None:
                break
            self._changed.clear()
            await self._changed.wait()
        for g in chosen:
            del self._groups[g.draw.index]
        self._unsynced += len(chosen)
        chosen.sort(key=lambda g: g.draw.index)
        metrics = self._metrics(chosen, version)
        return StepGroups(
            [self.problems[g.draw.problem] for g in chosen],
            [g.trajectories for g in chosen],
            [g.kept for g in chosen],
            metrics,
        )

    def _metrics(self, chosen: list[_Group], version: int) -> dict[str, Any]:
        ages = [g.span.behind(version) for g in chosen]
        out: dict[str, Any] = {
            f"async/staleness/{a}": ages.count(a) for a in sorted({*range(self.k + 1), *ages})
        }
        out["async/dropped_stale"], self._dropped = self._dropped, 0
        out["async/retries_trained"] = sum(g.draw.retry for g in chosen)
        out["async/groups_ahead"] = len(self._groups)  # admitted for later steps (in flight or done)
        # The weights the step's tokens were sampled with: one version in the exact mode, by construction.
        started = [g.span for g in chosen if g.span.oldest is not None]
        out["async/behaviour_version_min"] = min((s.oldest for s in started), default=None)
        out["async/behaviour_version_max"] = max((s.newest for s in started), default=None)
        return out

    def synced(self, version: int) -> None:
        """The step's update reached the engines (now at `version`): admit the next groups."""
        self._unsynced = 0
        self.steps_done += 1
        self._drop_stale(version)
        self.fill()

    # --- checkpoint / close -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Draws admitted and not trained on (regenerated on resume, same seeds), then the queued ones."""
        pending = [g.draw for g in self._groups.values()] + list(self._queue)
        return {"pending": [[d.problem, d.index, d.retry] for d in pending], "next_index": self._next_index}

    async def close(self) -> None:
        if self.exact:
            self.versions.hold_syncs(None)
        tasks = [g.task for g in self._groups.values() if g.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._groups.clear()
