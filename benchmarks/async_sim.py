"""Synchronous vs asynchronous GRPO-RoC at the paper's scale, simulated: step time, trained tokens/s and
GPU idle fraction, side by side.

    .venv/bin/python benchmarks/async_sim.py [--gpus 64] [--trainer-gpus 16] [--prompts 512] [--group 32]

The rollouts are benchmarks/rollout_sim.RolloutSim (engines with vLLM-like continuous batching and KV
admission, decode time growing with batch and KV, tool latency between turns; placement by
tirl.engines.scheduler.Admission, the KV-aware scheduler), fed group by group by a driver that
follows tirl.rl.async_rollout.GroupProducer's rules: at most (k + 1) * P groups admitted and not yet
trained on, a trainer that takes P complete groups (first complete, first taken; re-queued prompts
about to go stale first), groups whose oldest turn started more than k versions behind the trainer
dropped and re-queued, and a weight sync after each update that pauses the engines and makes them
recompute their running requests' KV. k = 0 is the synchronous step.

Scenarios (all on the same `--gpus`, one engine per GPU):
- sync colocated: every GPU rolls out, then every GPU trains (verl's hybrid engine; the paper);
- sync disaggregated: `--trainer-gpus` train, the rest roll out, one after the other;
- async k = 1, 2, 4: the same split, rollouts and training overlapped.

Workload (why): the paper's 512 prompts x 32 rollouts (keep G = 16 by RoC), L = 8192 (stage 1); turn
lengths lognormal (median 700, sigma 1.2: right-skewed reasoning) scaled by a per-prompt difficulty
(lognormal, sigma 0.8: a hard prompt's rollouts are all long and tool-heavy), 1 + geometric turns up
to 10, tool latency lognormal around the paper's ~0.3 s. Trainer: time proportional to the kept
trajectories' tokens (prompt + response): 2.8e-4 GPU-s per token = forward + backward + the old
log-prob forward of a 14B model (8 * 14e9 FLOP) at ~400 TFLOP/s; weight sync 5 s.
Not modelled: early cancellation of a group known to be stale (the real producer cancels it; here it
runs to the end and its work is wasted: pessimistic for async), the trainer's own scaling losses.
"""

from __future__ import annotations

import argparse
import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field

from rollout_sim import EngineModel, RolloutSim, Workload

KEEP = 0.5  # RoC trains on G of 2G rollouts


@dataclass(frozen=True)
class TrainerModel:
    per_token_gpu_s: float = 2.8e-4  # see the module docstring
    sync_s: float = 5.0  # weights into the engines (28 GB in bf16) and loaded


@dataclass(frozen=True)
class Scenario:
    name: str
    engine_gpus: int
    trainer_gpus: int
    staleness: int  # k; 0 = synchronous


@dataclass
class Outcome:
    scenario: Scenario
    step_s: float  # mean step time over the measured steps
    trained_tokens_per_s: float
    gpu_idle: float  # share of GPU-seconds neither decoding nor training
    engine_idle: float  # share of the engines' time with nothing to decode
    trainer_idle: float  # share of the trainer's time waiting for groups
    dropped: int  # stale groups dropped (and re-queued)
    recomputed_tokens: int  # KV re-prefilled after weight syncs (requests in flight) and preemptions
    trained_groups: int
    staleness: Counter = field(default_factory=Counter)  # trained groups by versions behind


@dataclass
class _Group:
    index: int
    members: list[int]
    retry: bool = False
    oldest: int | None = None  # the version when its first member started
    done: int = 0
    doomed: bool = False  # dropped as stale: its members run on, their work wasted
    completed_at: int = 0
    tokens: int = 0  # tokens of the members RoC keeps


class _Driver:
    """GroupProducer's admission and staleness rules, and a trainer, on a RolloutSim."""

    def __init__(
        self,
        scenario: Scenario,
        workload: Workload,
        engine: EngineModel,
        trainer: TrainerModel,
        steps: int,
        seed: int,
    ):
        self.s, self.w, self.trainer, self.steps = scenario, workload, trainer, steps
        self.P, self.k = workload.prompts, scenario.staleness
        self.sim = RolloutSim(scenario.engine_gpus, engine, "dynamic", workload.max_len)
        self.sim.on_start, self.sim.on_finish = self._started, self._finished
        self.rng = random.Random(seed)
        self.version, self.synced_steps, self.unsynced = 0, 0, 0
        self.groups: dict[int, _Group] = {}  # admitted and not taken (nor doomed)
        self.of_traj: dict[int, _Group] = {}
        self.queue: deque[bool] = deque()  # re-queued prompts waiting for room (retry flags)
        self.draws = self.completions = self.dropped = 0
        self.training = False
        self.train_s = 0.0
        self.wait_since: float | None = 0.0
        self.trainer_wait_s = 0.0
        self.step_ends: list[float] = []
        self.step_tokens: list[int] = []
        self.staleness: Counter = Counter()

    # --- admission -----------------------------------------------------------------------------
    def fill(self) -> None:
        room = min(self.k + 1, self.steps - self.synced_steps) * self.P - len(self.groups) - self.unsynced
        for _ in range(max(0, room)):
            retry = self.queue.popleft() if self.queue else False
            specs = self.w.sample_group(self.rng, f"g{self.draws}")
            group = _Group(self.draws, [], retry)
            self.draws += 1
            self.groups[group.index] = group
            for j, spec in enumerate(specs):
                i = len(self.sim.trajs)  # the index submit gives (on_start may fire inside it)
                group.members.append(i)
                self.of_traj[i] = group
                self.sim.submit(spec)
                if j < KEEP * len(specs):
                    group.tokens += spec.length

    def _started(self, traj: int) -> None:
        group = self.of_traj[traj]
        if group.oldest is None:
            group.oldest = self.version

    def _finished(self, traj: int, now: float) -> None:
        group = self.of_traj.pop(traj)
        group.done += 1
        if group.done == len(group.members) and not group.doomed:
            group.completed_at = self.completions
            self.completions += 1
            self.take()

    def drop_stale(self) -> None:
        for group in list(self.groups.values()):
            if not group.retry and group.oldest is not None and self.version - group.oldest > self.k:
                group.doomed = True
                del self.groups[group.index]
                self.queue.appendleft(True)
                self.dropped += 1

    # --- trainer -------------------------------------------------------------------------------
    def take(self) -> None:
        if self.training or self.synced_steps >= self.steps:
            return
        self.drop_stale()
        due = [
            g
            for g in self.groups.values()
            if g.retry and g.oldest is not None and self.version - g.oldest >= self.k
        ]
        if any(g.done < len(g.members) for g in due):
            return
        ready = sorted(
            (g for g in self.groups.values() if g.done == len(g.members) and g not in due),
            key=lambda g: g.completed_at,
        )
        chosen = due + ready[: max(0, self.P - len(due))]
        if len(chosen) < self.P:
            return
        for g in chosen:
            del self.groups[g.index]
            self.staleness[self.version - g.oldest] += 1
        self.unsynced += len(chosen)
        tokens = sum(g.tokens for g in chosen)
        seconds = tokens * self.trainer.per_token_gpu_s / self.s.trainer_gpus
        self.training, self.train_s = True, self.train_s + seconds
        self.trainer_wait_s += self.sim.now - self.wait_since
        self.step_tokens.append(tokens)
        self.sim.at(self.sim.now + seconds, self._sync)

    def _sync(self) -> None:
        self.sim.pause(self.trainer.sync_s)
        self.sim.at(self.sim.now + self.trainer.sync_s, self._synced)

    def _synced(self) -> None:
        self.version += 1
        self.synced_steps += 1
        self.unsynced = 0
        self.training = False
        self.wait_since = self.sim.now
        self.step_ends.append(self.sim.now)
        self.drop_stale()
        self.fill()
        self.take()

    def run(self, warmup: int, gpus: int) -> Outcome:
        self.fill()
        self.sim.run()
        if self.synced_steps < self.steps:
            raise RuntimeError(f"{self.s.name}: only {self.synced_steps} of {self.steps} steps finished")
        start, end = self.step_ends[warmup - 1] if warmup else 0.0, self.step_ends[-1]
        wall = end - start
        measured = self.steps - warmup
        busy = self.sim.busy_seconds() + self.train_s * self.s.trainer_gpus
        total = self.step_ends[-1]
        return Outcome(
            self.s,
            step_s=wall / measured,
            trained_tokens_per_s=sum(self.step_tokens[warmup:]) / wall,
            gpu_idle=1.0 - busy / (gpus * total),
            engine_idle=1.0 - self.sim.busy_seconds() / (self.s.engine_gpus * total),
            trainer_idle=self.trainer_wait_s / total,
            dropped=self.dropped,
            recomputed_tokens=self.sim.result().recomputed_tokens,
            trained_groups=sum(self.staleness.values()),
            staleness=self.staleness,
        )


def paper_workload(prompts: int, group: int, max_len: int = 8192) -> Workload:
    return Workload(
        "paper stage 1",
        turn_tokens=lambda r: r.lognormvariate(math.log(700), 1.2),
        tool_latency_s=lambda r: r.lognormvariate(math.log(0.3), 1.0),
        prompts=prompts,
        group_size=group,
        max_len=max_len,
        difficulty_sigma=0.8,
    )


def scenarios(gpus: int, trainer_gpus: int, ks: list[int]) -> list[Scenario]:
    engines = gpus - trainer_gpus
    return [
        Scenario("sync colocated", gpus, gpus, 0),
        Scenario("sync disaggregated", engines, trainer_gpus, 0),
        *(Scenario(f"async k={k}", engines, trainer_gpus, k) for k in ks),
    ]


def simulate_training(
    scenario: Scenario,
    workload: Workload,
    engine: EngineModel,
    trainer: TrainerModel,
    steps: int,
    warmup: int,
    gpus: int,
    seed: int = 0,
) -> Outcome:
    """Train `steps` steps; the measured window skips the first `warmup` (the pipeline filling)."""
    if not 0 <= warmup < steps:
        raise ValueError(f"warmup={warmup} must leave steps to measure (steps={steps})")
    return _Driver(scenario, workload, engine, trainer, steps, seed).run(warmup, gpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--trainer-gpus", type=int, default=16, help="disaggregated and async: GPUs that train")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--group", type=int, default=32, help="rollouts per prompt (2G)")
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-tokens", type=int, default=900_000, help="KV tokens per engine")
    args = ap.parse_args()
    if not 0 < args.trainer_gpus < args.gpus:
        raise SystemExit(f"--trainer-gpus must be between 1 and {args.gpus - 1}")
    workload = paper_workload(args.prompts, args.group, args.max_len)
    engine, trainer = EngineModel(kv_tokens=args.kv_tokens), TrainerModel()
    print(
        f"{args.gpus} GPUs ({args.gpus - args.trainer_gpus} engines + {args.trainer_gpus} trainers when split), "
        f"{args.prompts} prompts x {args.group} rollouts, L={args.max_len}, {args.steps} steps "
        f"({args.warmup} warm-up not measured), seed {args.seed}"
    )
    print(
        f"{'scenario':<20} {'step s':>8} {'trained tok/s':>14} {'x colocated':>12} {'GPU idle':>9} "
        f"{'engine idle':>12} {'trainer idle':>13} {'dropped':>8}  staleness (groups by versions behind)"
    )
    base = None
    for sc in scenarios(args.gpus, args.trainer_gpus, args.k):
        out = simulate_training(sc, workload, engine, trainer, args.steps, args.warmup, args.gpus, args.seed)
        base = base or out.trained_tokens_per_s
        hist = " ".join(f"{a}:{n}" for a, n in sorted(out.staleness.items()))
        print(
            f"{sc.name:<20} {out.step_s:>8.0f} {out.trained_tokens_per_s:>14,.0f} "
            f"{out.trained_tokens_per_s / base:>11.2f}x {out.gpu_idle:>9.1%} {out.engine_idle:>12.1%} "
            f"{out.trainer_idle:>13.1%} {out.dropped:>8}  {hist}",
            flush=True,
        )


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # its engines, sandboxes and workers die with it, even on kill -9
    main()
