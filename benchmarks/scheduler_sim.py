"""Dynamic (KV-cache-aware) vs static rollout scheduling, simulated at cluster scale.

    .venv/bin/python benchmarks/scheduler_sim.py [--engines 4] [--prompts 64] [--group 16]
    .venv/bin/python benchmarks/scheduler_sim.py --paper-layout --prompts 128 --group 32
    .venv/bin/python benchmarks/scheduler_sim.py --programs --engines 64 --prompts 512 --group 32 \
        --seeds 1 --kv-tokens 280000 [--only NAME]

--programs: tirl's Admission beside ThunderAgent's program-level scheduling (pause/resume at tool
calls, smallest-first) and a group-first variant, with tool latencies drawn from the sandbox's
measured distribution; step time, KV use and waits (docs/scheduler.md).

Each load shape is a batch of prompts x group multi-turn trajectories (length limit L) on E engines
of one cost model (rollout_sim.EngineModel: a 14B model on one 80 GB GPU). What is modelled (see
rollout_sim): vLLM-like in-engine FCFS admission by free KV, recompute preemption (the victim
re-prefills its whole context and waits at the head of the queue), prefix-cache eviction between
turns, decode step time growing with batch size and KV read, tool latency between turns.
Distributions (why these):
- tokens per turn: lognormal (reasoning lengths are right-skewed; sigma sets the tail) or Pareto
  (a power-law tail: a few trajectories run to the length limit, the pattern RL rollouts show);
- per-prompt difficulty ("group corr."): a lognormal factor shared by the group's rollouts scales
  their turn lengths and number of turns (hard prompts: all long, many tool calls);
- turns: 1 + geometric (most trajectories stop after a few calls, some use the whole budget);
- tool latency: lognormal around the paper's ~0.3 s average, with a heavy tail for slow code.
Schedulers: static = whole groups round-robin, N/E trajectories per engine up front (verl v0.2),
tool calls asynchronous per trajectory like dynamic's (the main baseline), and also turn-synchronous
("vs sync": each engine's batch waits for its slowest turn and slowest tool call, as batched
multi-turn rollouts do); dynamic = tirl.engines.scheduler.Admission, the policy RolloutScheduler
runs, with its rules: full L (reserve=1.0, never preempts), the paper's literal free-KV // L, and
reserve=r growth-following. Prints static / dynamic makespan ratios (> 1: dynamic is faster),
preemptions and recomputed tokens.

What it shows (defaults, 3 batches per shape): static with vLLM's in-engine admission runs every
engine with a full KV cache and pays for it in preemptions (millions of recomputed tokens), yet a
full cache decodes more tokens per step than a reservation-limited one, so against that async
baseline dynamic is at par (0.9-1.15x at r=0.7, no preemptions; 0.76-0.99x at full L); its gain over
static comes from engines given hard groups (util column) and is eaten by its smaller batches.
Against turn-synchronous static, dynamic is 1.3-3x faster.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import math
import random
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Literal

from rollout_sim import EngineModel, Placed, SimResult, TrajectorySpec, Workload, simulate
from tirl.engines.scheduler import Admission

# Latency of one call to tirl's sandbox service (HTTP, full isolation), measured 2026-12-07 at
# 732085e on the 2-core development machine at load 1.0: 300 calls each of the bench's trivial,
# numpy and sympy cells (tirl.sandbox.bench.WORKLOADS) at concurrency 4, pooled (900 calls, mean
# 35 ms). Quantiles at 0, 5, 10, 20, ..., 90, 95, 99, 100 %, in ms.
SANDBOX_QUANTILES = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
SANDBOX_LATENCY_MS = (9.1, 10.8, 11.4, 13.8, 16.3, 20.1, 21.8, 25.6, 56.5, 64.6, 72.1, 79.0, 87.3, 93.6)
SANDBOX_MEAN_S = 0.0349


def sandbox_latency(scale: float = 1.0) -> Callable[[random.Random], float]:
    """Draw from the measured distribution (inverse CDF, linear between quantiles), times `scale`."""

    def draw(r: random.Random) -> float:
        u = r.random()
        i = min(bisect.bisect_right(SANDBOX_QUANTILES, u), len(SANDBOX_QUANTILES) - 1)
        q0, q1 = SANDBOX_QUANTILES[i - 1], SANDBOX_QUANTILES[i]
        v0, v1 = SANDBOX_LATENCY_MS[i - 1], SANDBOX_LATENCY_MS[i]
        return scale * (v0 + (v1 - v0) * (u - q0) / (q1 - q0)) / 1000

    return draw


def lognormal(median: float, sigma: float):
    return lambda r: r.lognormvariate(math.log(median), sigma)


def pareto(scale: float, alpha: float):
    return lambda r: scale * r.paretovariate(alpha)


# --- program-level scheduling (ThunderAgent, arXiv 2602.13692) ---------------------------------------
BUFFER_PER_PROGRAM = 100  # ThunderAgent's decode headroom counted per active program
Order = Literal["smallest", "group"]


@dataclass
class _Program:
    group_rank: int  # order in which its group was first seen
    seq: int
    tokens: int  # its context: what it holds of the KV cache while active
    engine: int | None = None  # None: holds no capacity (new or paused)
    last_engine: int | None = None  # where its context was left when paused (a resume there may hit it)
    acting: bool = False  # in a tool call
    marked: bool = False  # reasoning on an over-full engine: paused at its next tool boundary


class ProgramScheduler:
    """ThunderAgent's program-level scheduler, as its paper and wiki describe it (no code of it here).

    A program counts its real context (plus a 100-token buffer) against its engine's KV capacity,
    never a reservation for growth. When an engine is over capacity, programs waiting on a tool are
    paused (their KV becomes evictable; resuming on another engine re-prefills it), and reasoning
    ones are marked to pause at their next tool call. Waiting programs (paused ones whose tool call
    returned first, then new ones) are admitted while they fit, each on the engine with the most
    room (its old engine if that fits). order="smallest": fewest tokens first, in admission and in
    pausing (ThunderAgent's). order="group": oldest GRPO group first, pausing the youngest group's
    programs first, so a group's members move together.
    Scheduling is event-driven (at every tool boundary and finish), not every 5 s: the baseline's
    best case.
    """

    program_level = True  # the simulator reports every tool boundary

    def __init__(self, n_engines: int, kv_tokens: int, order: Order, size: Callable[[Hashable], int]):
        if order not in ("smallest", "group"):
            raise ValueError(f"unknown order {order!r}: use 'smallest' or 'group'")
        self.order, self.capacity, self._size = order, kv_tokens, size
        self.load = [0] * n_engines  # tokens + buffers of the programs active on each engine
        self.marked = [0] * n_engines  # of which marked to pause: counted as already gone
        self.members: list[set[Hashable]] = [set() for _ in range(n_engines)]
        self.programs: dict[Hashable, _Program] = {}
        self.queue: list[tuple[tuple[int, ...], Hashable]] = []  # heap of waiting programs
        self.pauses = 0
        self._groups: dict[str, int] = {}

    # --- the simulator's interface ---------------------------------------------------------------
    def submit(self, ticket: Hashable, group: str, max_tokens: int) -> int | None:
        rank = self._groups.setdefault(group, len(self._groups))
        self.programs[ticket] = _Program(rank, len(self.programs), self._size(ticket))
        self._enqueue(ticket, resumed=False)
        return None  # placed by `schedule`, together with the rest of its burst

    def schedule(self) -> Placed:
        """Admit waiting programs in order while the head fits somewhere (nobody overtakes)."""
        placed: Placed = []
        while self.queue:
            ticket = self.queue[0][1]
            engine = self._fit(self.programs[ticket])
            if engine is None:
                break
            heapq.heappop(self.queue)
            self._activate(ticket, engine)
            placed.append((ticket, engine))
        return placed

    def observe(self, ticket: Hashable, context_tokens: int) -> None:
        program = self.programs[ticket]
        delta, program.tokens = context_tokens - program.tokens, context_tokens
        if program.engine is None:
            return
        self.load[program.engine] += delta
        if program.marked:
            self.marked[program.engine] += delta
        self._relieve(program.engine)

    def tool_started(self, ticket: Hashable) -> Placed:
        program = self.programs[ticket]
        program.acting = True
        if program.marked:
            self._pause(ticket)
        return self.schedule()

    def tool_returned(self, ticket: Hashable) -> Placed:
        program = self.programs[ticket]
        program.acting = False
        if program.engine is not None:
            return [(ticket, program.engine)]
        self._enqueue(ticket, resumed=True)
        return self.schedule()

    def release(self, ticket: Hashable) -> Placed:
        if self.programs[ticket].engine is not None:
            self._deactivate(ticket)
        del self.programs[ticket]
        return self.schedule()

    # --- internals ------------------------------------------------------------------------------
    def _enqueue(self, ticket: Hashable, resumed: bool) -> None:
        p = self.programs[ticket]
        wave = 0 if resumed else 1  # a program with a turn to run goes before new ones
        key = (wave, p.tokens, p.seq) if self.order == "smallest" else (p.group_rank, wave, p.seq)
        heapq.heappush(self.queue, (key, ticket))

    def _fits(self, engine: int, tokens: int) -> bool:
        need = tokens + BUFFER_PER_PROGRAM
        return not self.members[engine] or self.load[engine] + need <= self.capacity

    def _fit(self, program: _Program) -> int | None:
        if program.last_engine is not None and self._fits(program.last_engine, program.tokens):
            return program.last_engine
        emptiest = min(range(len(self.load)), key=self.load.__getitem__)
        return emptiest if self._fits(emptiest, program.tokens) else None

    def _activate(self, ticket: Hashable, engine: int) -> None:
        program = self.programs[ticket]
        program.engine = engine
        self.load[engine] += program.tokens + BUFFER_PER_PROGRAM
        self.members[engine].add(ticket)

    def _deactivate(self, ticket: Hashable) -> None:
        program = self.programs[ticket]
        engine = program.engine
        assert engine is not None
        self.load[engine] -= program.tokens + BUFFER_PER_PROGRAM
        if program.marked:
            self.marked[engine] -= program.tokens
            program.marked = False
        self.members[engine].discard(ticket)
        program.engine, program.last_engine = None, engine

    def _pause(self, ticket: Hashable) -> None:
        """Only programs in a tool call are paused: the return of their call queues them to resume."""
        self._deactivate(ticket)
        self.pauses += 1

    def _victim_order(self, ticket: Hashable) -> tuple[int, ...]:
        p = self.programs[ticket]
        return (p.tokens, p.seq) if self.order == "smallest" else (-p.group_rank, -p.seq)

    def _relieve(self, engine: int) -> None:
        """Over capacity: pause programs in tool calls, then mark reasoning ones, in victim order."""
        if self.load[engine] - self.marked[engine] <= self.capacity:
            return
        candidates = sorted(
            (t for t in self.members[engine] if not self.programs[t].marked), key=self._victim_order
        )
        for acting in (True, False):
            for ticket in candidates:
                if self.load[engine] - self.marked[engine] <= self.capacity:
                    return
                program = self.programs[ticket]
                if program.acting != acting or program.engine is None:
                    continue
                if acting:
                    self._pause(ticket)
                else:
                    program.marked = True
                    self.marked[engine] += program.tokens


def load_shapes(prompts: int, group: int) -> list[Workload]:
    common = {"prompts": prompts, "group_size": group}
    heavy, tools = lognormal(700, 1.2), lognormal(0.3, 1.0)
    hard = {**common, "difficulty_sigma": 0.8}
    return [
        Workload(
            "tiny demo (L=1536, short)",
            lognormal(120, 1.0),
            tools,
            max_len=1536,
            max_turns=6,
            prompt_tokens=lognormal(64, 0.2),
            tool_tokens=lognormal(20, 0.5),
            **common,
        ),
        Workload("light tail (s=0.5)", lognormal(900, 0.5), lognormal(0.3, 0.5), **common),
        Workload("heavy tail (s=1.2), indep.", heavy, tools, **common),
        Workload("heavy tail, group corr.", heavy, tools, **hard),
        Workload("power law (a=1.3), group corr.", pareto(500, 1.3), tools, **hard),
        Workload("slow tools, group corr.", heavy, lognormal(1.0, 1.5), **hard),
        Workload("many turns (6), group corr.", lognormal(400, 1.2), tools, mean_turns=6.0, **hard),
        Workload("paper-like (L=16k), group corr.", lognormal(1500, 1.2), tools, max_len=16384, **hard),
    ]


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def run_batch(shape: Workload, seed: int, n_engines: int, engine: EngineModel, variants) -> list[SimResult]:
    """One sampled batch under static and every dynamic variant (the same trajectories for all)."""
    specs = shape.sample(seed=seed)
    runs = [simulate(specs, n_engines, engine, "static", shape.max_len)]
    runs += [simulate(specs, n_engines, engine, "dynamic", shape.max_len, **kw) for _, kw in variants]
    return [*runs, simulate(specs, n_engines, engine, "static", shape.max_len, sync_turns=True)]


def paper_layout(prompts: int, group: int, reserve: float, seed: int = 0) -> None:
    """The paper's 64 GPUs as 8 nodes x 8: one engine per GPU on every node (the `ray` runtime) vs
    engines on rank 0's node only (torchrun: every engine lives in rank 0's process)."""
    engine = EngineModel()
    shape = next(s for s in load_shapes(prompts, group) if s.name.startswith("paper-like"))
    specs = shape.sample(seed=seed)
    print(f"\npaper layout, {shape.name}: {prompts} prompts x {group} rollouts, dynamic r={reserve}")
    rows = []
    for label, n_engines in (("rank 0's node only (8 engines)", 8), ("all 8 nodes (64 engines)", 64)):
        t0 = time.perf_counter()
        result = simulate(specs, n_engines, engine, "dynamic", shape.max_len, reserve=reserve)
        rows.append((label, result))
        print(
            f"  {label:32} makespan {result.makespan_s:8.1f} s  util {result.utilization:.2f}  "
            f"preemptions {result.preemptions}  (simulated in {time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    print(
        f"  engines on all nodes: {rows[0][1].makespan_s / rows[1][1].makespan_s:.2f}x shorter rollout phase"
    )


# --- tirl's scheduler vs program-level scheduling, at the paper's layout ---------------------------
@dataclass(frozen=True)
class PolicyRow:
    name: str
    result: SimResult
    worst_wait_s: float  # the longest any program waited to run (queued, paused or preempted)
    longest_wait_s: float  # the wait of the program with the longest prompt (ThunderAgent#46's case)
    slowest_group_wait_s: float  # the group that finished last: its members' longest wait
    pauses: int = 0


def wait_stats(specs: list[TrajectorySpec], result: SimResult) -> tuple[float, float, float]:
    """(worst wait, the longest-prompt program's wait, the slowest group's longest wait)."""
    waits = result.waits_s
    longest = max(range(len(specs)), key=lambda i: (specs[i].prompt_tokens, specs[i].length))
    finish: dict[str, float] = {}
    for spec, end in zip(specs, result.finish_s, strict=True):
        finish[spec.group] = max(finish.get(spec.group, 0.0), end)
    slowest = max(finish, key=finish.__getitem__)
    group_wait = max(w for spec, w in zip(specs, waits, strict=True) if spec.group == slowest)
    return max(waits), waits[longest], group_wait


def paper_workload(prompts: int, group: int, max_len: int, tool_scale: float) -> Workload:
    """rStar2-Agent's batch: heavy-tailed turns with per-prompt difficulty, long-tailed prompts."""
    return Workload(
        "paper-like, sandbox tools",
        lognormal(700, 1.2),
        sandbox_latency(tool_scale),
        prompts=prompts,
        group_size=group,
        max_len=max_len,
        difficulty_sigma=0.8,
        prompt_tokens=lognormal(300, 1.0),  # a long tail of long problem statements
    )


TIRL_VARIANTS = (  # name, reserve, pause, group affinity
    ("tirl full L (default)", 1.0, True, True),  # full L is never over its budget: it never pauses
    ("tirl r=0.7, no pausing", 0.7, False, True),
    ("tirl r=0.1 + pausing", 0.1, True, True),
    ("tirl r=0.1 + pausing, spread", 0.1, True, False),
)


def compare_policies(
    specs: list[TrajectorySpec], n_engines: int, engine: EngineModel, max_len: int, only: str = ""
) -> list[PolicyRow]:
    """tirl's Admission (its default full L; r=0.7 without pausing; r=0.1 pausing at tool calls, with
    and without group affinity) beside program-level scheduling, smallest-first (ThunderAgent) and
    group-first."""
    rows = []
    for name, reserve, pause, affinity in TIRL_VARIANTS:
        if only not in name:
            continue
        policy = Admission(
            n_engines,
            "dynamic",
            lambda e: engine.kv_tokens,
            reserve=reserve,
            pause=pause,
            group_affinity=affinity,
        )
        result = simulate(specs, n_engines, engine, "dynamic", max_len, policy=policy)
        rows.append(PolicyRow(name, result, *wait_stats(specs, result), pauses=policy.pauses))
    for name, order in (("ThunderAgent (smallest-first)", "smallest"), ("group-aware programs", "group")):
        if only not in name:
            continue
        policy = ProgramScheduler(n_engines, engine.kv_tokens, order, lambda t: t.spec.prompt_tokens)
        result = simulate(specs, n_engines, engine, "dynamic", max_len, policy=policy)
        rows.append(PolicyRow(name, result, *wait_stats(specs, result), pauses=policy.pauses))
    return rows


def print_policies(rows: list[PolicyRow]) -> None:
    print(
        f"{'policy':30} {'step s':>8} {'KV run':>6} {'KV held':>7} {'worst wait s':>12} "
        f"{'longest prog. wait s':>20} {'slowest group wait s':>20} {'pauses':>7} {'preempt.':>8} {'recomp. Mtok':>12}"
    )
    for row in rows:
        r = row.result
        print(
            f"{row.name:30} {r.makespan_s:8.1f} {r.kv_running:6.2f} {r.kv_held:7.2f} {row.worst_wait_s:12.2f} "
            f"{row.longest_wait_s:20.2f} {row.slowest_group_wait_s:20.2f} {row.pauses:7d} {r.preemptions:8d} "
            f"{r.recomputed_tokens / 1e6:12.2f}",
            flush=True,
        )


def program_layout(args: argparse.Namespace) -> None:
    """The paper's layout: one engine per GPU (64), 2G rollouts per prompt, an MI300X's KV budget."""
    engine = EngineModel(kv_tokens=args.kv_tokens)
    for scale in args.tool_scale:
        shape = paper_workload(args.prompts, args.group, args.max_len, scale)
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            specs = shape.sample(seed=seed)
            mean_tool = scale * SANDBOX_MEAN_S
            print(
                f"\n{args.engines} engines x {engine.kv_tokens} KV tokens, {args.prompts} prompts x {args.group} "
                f"rollouts, L={args.max_len}, tool latency = sandbox x {scale:g} (mean {mean_tool:.3f} s), "
                f"seed {seed}"
            )
            t0 = time.perf_counter()
            print_policies(compare_policies(specs, args.engines, engine, args.max_len, args.only))
            print(f"(simulated in {time.perf_counter() - t0:.0f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--kv-tokens", type=int, default=EngineModel.kv_tokens)
    ap.add_argument("--reserve", type=float, default=0.7, help="share of L reserved by the growth rule")
    ap.add_argument("--seeds", type=int, default=3, help="batches per shape; ratios are geometric means")
    ap.add_argument(
        "--paper-layout", action="store_true", help="only the 64-GPU (8 nodes) engine placement comparison"
    )
    ap.add_argument(
        "--programs",
        action="store_true",
        help="only tirl's scheduler vs program-level (ThunderAgent) and group-aware scheduling",
    )
    ap.add_argument("--max-len", type=int, default=8192, help="--programs: L")
    ap.add_argument("--only", default="", help="--programs: only the policies whose name contains this")
    ap.add_argument("--first-seed", type=int, default=0, help="--programs: the first batch's seed")
    ap.add_argument(
        "--tool-scale",
        type=float,
        nargs="+",
        default=[1.0],
        help="--programs: tool latency = the sandbox's measured distribution times these factors",
    )
    args = ap.parse_args()
    if args.programs:
        program_layout(args)
        return
    if args.paper_layout:
        paper_layout(args.prompts, args.group, args.reserve)
        return
    engine = EngineModel(kv_tokens=args.kv_tokens)
    n = args.prompts * args.group
    variants = [
        ("full L", {"reserve": 1.0}),
        ("free KV", {"rule": "free_kv"}),
        (f"r={args.reserve}", {"reserve": args.reserve}),
    ]
    print(
        f"{args.engines} engines x {engine.kv_tokens} KV tokens, {args.prompts} prompts x {args.group} "
        f"rollouts: static gives each engine {n // args.engines} up front (whole groups); dynamic: "
        + ", ".join(name for name, _ in variants)
        + "\n"
    )
    names = "/".join(["st"] + [name for name, _ in variants])
    header = (
        f"{'load shape':32} {'L':>5} {'mean len':>8} {'static s':>8} "
        + " ".join(f"{name:>8}" for name, _ in variants)
        + f" {'worst':>9} {'vs sync':>9} {'util ' + names:>24} {'preemptions':>20} {'recomputed Mtok':>20}"
    )
    print(header)
    print(f"{'':{len(header) - 42}}{names:>20} {names:>20}")
    print("-" * len(header))
    t0 = time.perf_counter()
    for shape in load_shapes(args.prompts, args.group):
        runs = [run_batch(shape, seed, args.engines, engine, variants) for seed in range(args.seeds)]
        base = [batch[0].makespan_s for batch in runs]
        ratios = [
            geomean([b / batch[v].makespan_s for b, batch in zip(base, runs, strict=True)]) for v in (1, 2, 3)
        ]
        worst = min(b / batch[3].makespan_s for b, batch in zip(base, runs, strict=True))
        vs_sync = geomean([batch[4].makespan_s / batch[3].makespan_s for batch in runs])
        mean_len = sum(s.length for s in shape.sample(seed=0)) / (args.prompts * args.group)

        def per_variant(stat, runs=runs) -> str:
            return "/".join(stat([batch[v] for batch in runs]) for v in range(4))

        print(
            f"{shape.name:32} {shape.max_len:5d} {mean_len:8.0f} {sum(base) / len(base):8.1f} "
            + " ".join(f"{r:7.2f}x" for r in ratios)
            + f" {worst:8.2f}x {vs_sync:8.2f}x"
            + f" {per_variant(lambda xs: f'{sum(x.utilization for x in xs) / len(xs):.2f}'):>24}"
            + f" {per_variant(lambda xs: str(sum(x.preemptions for x in xs))):>20}"
            + f" {per_variant(lambda xs: f'{sum(x.recomputed_tokens for x in xs) / 1e6:.1f}'):>20}",
            flush=True,
        )
    print(
        f"\n(simulated in {time.perf_counter() - t0:.1f} s; dynamic columns = static makespan / dynamic "
        "makespan (geometric mean over the batches), > 1 is faster than static; worst = the r column's\n"
        "lowest batch; vs sync = the r column against static with turn-synchronous tool calls; util = mean\n"
        "share of the makespan engines compute; preemptions and recomputed tokens: summed over the batches)"
    )


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # its engines, sandboxes and workers die with it, even on kill -9
    main()
