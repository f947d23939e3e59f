"""Discrete-event simulation of multi-turn rollouts on E inference engines with a KV-cache budget.

It answers "how much does KV-cache-aware scheduling save?" at cluster scale on a laptop. The
placement of trajectories onto engines is `tirl.engines.scheduler.Admission` itself (dynamic, or
static: whole groups round-robin, N/E per engine up front); what is simulated is the rest.

Modelled:
- in-engine admission like vLLM's scheduler, the same for both modes: FCFS admission of turn
  requests while their context fits the free KV (no reservation for growth), up to max_seqs;
- recompute preemption: when decode growth overflows the cache the newest running request is
  evicted, goes back to the head of the waiting queue, and on re-admission re-prefills its whole
  context (counted as recomputed tokens, charged at prefill cost while the batch waits); under
  sustained overflow the same requests are evicted again (thrash);
- decode cost: a step costs `step_base_s + step_per_seq_s * batch + step_per_kv_token_s * KV read`,
  so an over-full engine decodes each sequence more slowly; prefill costs `prefill_per_token_s`;
- between turns (tool call) a trajectory's KV stays as evictable prefix cache; if it was evicted
  meanwhile the next turn recomputes it (also counted as recomputed tokens); the next turn queues
  FCFS behind the engine's waiting requests;
- group-correlated difficulty (`Workload.difficulty_sigma`): a prompt's rollouts are all long or
  all short, so engines given whole groups up front get unequal work.
Not modelled: shared-prefix reuse within a group (both modes keep a group on one engine), prefix
cache hits on re-admission after preemption (the freed blocks are usually reused at once under
overflow), chunked-prefill step limits, and the trainer's time (benchmarks/async_sim.py drives
`RolloutSim` with a trainer).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tirl.engines.scheduler import Admission, Mode, Rule

Sampler = Callable[[random.Random], float]
Placed = list[tuple[Any, int]]  # (trajectory, engine) pairs a policy starts or resumes now


class Placement(Protocol):
    """What RolloutSim asks of a placement policy (tirl's Admission is one).

    A program-level policy (`program_level` true: benchmarks/scheduler_sim.py's ProgramScheduler,
    Admission with pause=True) also has `tool_started(traj) -> Placed`,
    `tool_returned(traj) -> Placed` and `schedule() -> Placed`: it learns of every tool boundary and
    decides where (and when) the next turn runs, possibly on another engine, or later (the program was
    paused); its `submit` may queue everything and place it at `schedule`, called once per burst.
    """

    def submit(self, ticket: Any, group: str, max_tokens: int) -> int | None: ...
    def observe(self, ticket: Any, context_tokens: int) -> None: ...
    def release(self, ticket: Any) -> Placed: ...


@dataclass(frozen=True)
class EngineModel:
    """Cost model of one inference engine (defaults: a 14B model on one 80 GB GPU, order of magnitude)."""

    kv_tokens: int = 280_000  # KV tokens: ~45 GB left on an 80 GB GPU at 160 KB/token (Qwen3-14B bf16)
    max_seqs: int = 256  # most requests decoded together
    step_base_s: float = 0.012  # weights read once per decode step
    step_per_seq_s: float = 6e-5  # compute per sequence in the batch
    step_per_kv_token_s: float = 5e-8  # attention reads the whole KV of the batch
    prefill_per_token_s: float = 6e-5
    max_jump_s: float = 0.2  # longest stretch simulated as one block of decode steps


@dataclass(frozen=True)
class TrajectorySpec:
    group: str
    prompt_tokens: int
    turn_tokens: list[int]  # tokens generated in each turn
    tool_tokens: list[int]  # tokens of the tool response after turn i (len = turns - 1)
    tool_latency_s: list[float]

    @property
    def length(self) -> int:
        return self.prompt_tokens + sum(self.turn_tokens) + sum(self.tool_tokens)


@dataclass(frozen=True)
class Workload:
    """A rollout batch: `prompts` x `group_size` trajectories drawn from length/latency distributions."""

    name: str
    turn_tokens: Sampler
    tool_latency_s: Sampler
    mean_turns: float = 3.0  # turns ~ 1 + geometric, capped at max_turns
    prompts: int = 64
    group_size: int = 16
    max_len: int = 8192  # L: prompt + generated + tool tokens
    max_turns: int = 10
    # Per-prompt difficulty d ~ lognormal with mean 1: a hard prompt makes all its group's rollouts
    # long (turn tokens x d) and tool-heavy (mean turns x d). 0: rollouts are independent.
    difficulty_sigma: float = 0.0
    prompt_tokens: Sampler = field(default=lambda r: r.lognormvariate(math.log(300), 0.4))
    tool_tokens: Sampler = field(default=lambda r: r.lognormvariate(math.log(80), 0.8))

    def sample(self, seed: int = 0) -> list[TrajectorySpec]:
        rng = random.Random(seed)
        return [spec for p in range(self.prompts) for spec in self.sample_group(rng, f"p{p}")]

    def sample_group(self, rng: random.Random, group: str) -> list[TrajectorySpec]:
        """One prompt's `group_size` rollouts (sharing its prompt length and difficulty)."""
        prompt = min(int(self.prompt_tokens(rng)) + 16, self.max_len // 4)
        sigma = self.difficulty_sigma
        difficulty = rng.lognormvariate(-sigma * sigma / 2, sigma) if sigma else 1.0
        return [self._trajectory(rng, group, prompt, difficulty) for _ in range(self.group_size)]

    def _trajectory(self, rng: random.Random, group: str, prompt: int, difficulty: float) -> TrajectorySpec:
        stop = 1.0 / max(self.mean_turns * difficulty, 1.0)
        turns, tools, latencies, used = [], [], [], prompt
        while True:
            tokens = min(max(1, int(self.turn_tokens(rng) * difficulty)), self.max_len - used)
            turns.append(tokens)
            used += tokens
            if used >= self.max_len or len(turns) >= self.max_turns or rng.random() < stop:
                break
            tool = min(max(1, int(self.tool_tokens(rng))), self.max_len - used - 1)
            if tool <= 0:
                break
            tools.append(tool)
            latencies.append(self.tool_latency_s(rng))
            used += tool
        return TrajectorySpec(group, prompt, turns, tools, latencies)


@dataclass
class SimResult:
    mode: Mode
    makespan_s: float
    preemptions: int
    recomputed_tokens: int
    generated_tokens: int
    utilization: float  # mean fraction of the makespan engines spent computing
    mean_batch: float  # time-weighted running requests per busy engine
    kv_running: float = 0.0  # time-averaged share of the engines' KV held by requests being decoded
    kv_held: float = 0.0  # the same, plus the contexts kept between turns (prefix cache)
    waits_s: tuple[float, ...] = ()  # per trajectory: time ready to run but not running (queues, pauses)
    finish_s: tuple[float, ...] = ()  # per trajectory: when its last turn ended


class _Trajectory:
    def __init__(self, index: int, spec: TrajectorySpec):
        self.index = index
        self.spec = spec
        self.turn = 0
        self.context = 0  # tokens whose KV exists (or existed) for this trajectory
        self.engine = -1
        self.ready_at = 0.0  # when it last became ready to run (submitted, or its tool call returned)
        self.wait_s = 0.0
        self.finished_at = math.nan


@dataclass
class _Request:
    traj: _Trajectory
    new_tokens: int  # prompt or tool response to prefill
    decode_left: int
    ready: float = 0.0  # when it joined the waiting queue (its wait ends at admission)


class _Engine:
    def __init__(self, index: int, model: EngineModel):
        self.index = index
        self.model = model
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.running_kv = 0
        self.cached: OrderedDict[int, int] = OrderedDict()  # trajectory -> KV tokens kept between turns
        self.cached_kv = 0
        self.awake = False
        self.busy_s = 0.0
        self.batch_time = 0.0
        self.preemptions = 0
        self.recomputed = 0
        self.pending_prefill = 0  # KV to recompute before the next step (after a weight sync)
        self.kv_seconds = 0.0  # integral of the running KV over time (token-seconds)
        self.held_seconds = 0.0  # integral of running + cached KV
        self.accounted_until = 0.0

    def account(self, now: float) -> None:
        """Integrate the KV held since the last call (the state after a step stands for its duration)."""
        span = now - self.accounted_until
        if span > 0:
            self.kv_seconds += span * self.running_kv
            self.held_seconds += span * (self.running_kv + self.cached_kv)
            self.accounted_until = now

    def _evict_until(self, free_needed: int) -> None:
        while self.cached and self.model.kv_tokens - self.running_kv - self.cached_kv < free_needed:
            _, tokens = self.cached.popitem(last=False)  # least recently used prefix
            self.cached_kv -= tokens

    def _admit(self, now: float) -> int:
        """FCFS admission while contexts fit; returns tokens to prefill (new + recomputed)."""
        prefill = 0
        while self.waiting and len(self.running) < self.model.max_seqs:
            req = self.waiting[0]
            traj = req.traj
            need = traj.context + req.new_tokens
            held = self.cached.get(traj.index, 0)
            if self.running_kv + need - held > self.model.kv_tokens and self.running:
                break
            self.waiting.popleft()
            traj.wait_s += now - req.ready
            if held:
                del self.cached[traj.index]
                self.cached_kv -= held
            self.running_kv += need
            self._evict_until(0)
            self.recomputed += traj.context - held
            prefill += need - held
            traj.context = need
            self.running.append(req)
        return prefill

    def _preempt_newest(self, now: float) -> None:
        victim = self.running.pop()
        self.running_kv -= victim.traj.context
        # recomputed on re-admission
        self.waiting.appendleft(_Request(victim.traj, 0, victim.decode_left, now))
        self.preemptions += 1

    def step(self, now: float, next_arrival: float) -> tuple[float, list[_Request]]:
        """Run a block of decode steps; returns (its duration, requests whose turn ended)."""
        m = self.model
        prefill = self._admit(now)
        if not self.running:
            self.pending_prefill = 0
            return 0.0, []
        prefill, self.pending_prefill = prefill + self.pending_prefill, 0
        while self.running_kv + len(self.running) > m.kv_tokens and len(self.running) > 1:
            self._preempt_newest(now)
        n = len(self.running)
        step_s = m.step_base_s + m.step_per_seq_s * n + m.step_per_kv_token_s * self.running_kv
        k = min(r.decode_left for r in self.running)
        k = min(k, max(1, (m.kv_tokens - self.running_kv) // n))  # until the cache overflows
        k = min(k, max(1, int(min(m.max_jump_s, max(0.0, next_arrival - now)) / step_s)))
        self._evict_until(n * k)
        duration = prefill * m.prefill_per_token_s + k * (step_s + m.step_per_kv_token_s * n * (k - 1) / 2)
        finished, still = [], []
        for req in self.running:
            req.decode_left -= k
            req.traj.context += k
            (finished if req.decode_left == 0 else still).append(req)
        self.running_kv += n * k
        for req in finished:
            self.running_kv -= req.traj.context
        self.running = still
        self.busy_s += duration
        self.batch_time += n * duration
        return duration, finished

    def keep_prefix(self, traj: _Trajectory) -> None:
        self.cached[traj.index] = traj.context
        self.cached_kv += traj.context

    def drop_prefix(self, traj: _Trajectory) -> None:
        """The trajectory moved to another engine: its kept context here is dead."""
        self.cached_kv -= self.cached.pop(traj.index, 0)


def simulate(
    specs: list[TrajectorySpec],
    n_engines: int,
    engine: EngineModel,
    mode: Mode,
    max_len: int,
    reserve: float = 1.0,
    rule: Rule = "reserve",
    sync_turns: bool = False,
    policy: Placement | None = None,
) -> SimResult:
    """Roll out every trajectory on n_engines engines; placement by the scheduler's Admission.

    `max_len` is L, the length the scheduler reserves per trajectory (the lease's max_tokens).
    `sync_turns` (static only) runs each engine turn by turn, as a batched multi-turn rollout does:
    tool calls start when the engine's whole batch has ended its turn, and the next turn waits
    for the slowest tool call. Otherwise a tool call starts the moment its turn ends.
    `policy` replaces the Admission built from mode, reserve and rule (a program-level scheduler).
    """
    sim = RolloutSim(n_engines, engine, mode, max_len, reserve, rule, sync_turns, policy)
    for spec in specs:
        sim.submit(spec)
    sim.run()
    return sim.result()


class RolloutSim:
    """The event loop of `simulate`, open to drivers that submit trajectories over time and schedule
    their own events (benchmarks/async_sim.py: a trainer consuming groups while engines generate).

    `on_start(index)` is told when a trajectory is placed on an engine (its first turn queues there),
    `on_finish(index, time)` when its last turn ends; `pause(seconds)` stops every
    engine's decoding (a weight sync) and makes each re-prefill its running requests' KV afterwards
    (vLLM recomputes in-flight requests after a weight load).
    """

    def __init__(
        self,
        n_engines: int,
        engine: EngineModel,
        mode: Mode,
        max_len: int,
        reserve: float = 1.0,
        rule: Rule = "reserve",
        sync_turns: bool = False,
        policy: Placement | None = None,
    ):
        if sync_turns and mode != "static":
            raise ValueError("sync_turns models the turn-synchronous static baseline: use mode='static'")
        self.model, self.mode, self.max_len, self.sync_turns = engine, mode, max_len, sync_turns
        self.engines = [_Engine(e, engine) for e in range(n_engines)]
        self.policy: Placement = policy or Admission(
            n_engines, mode, budget_of=lambda e: engine.kv_tokens, reserve=reserve, rule=rule
        )
        # Program-level policies see every tool boundary (they may pause, move or hold the next turn).
        self._programs = getattr(self.policy, "program_level", False)
        # A full-L reservation never changes (a context never outgrows L): no need to report growth.
        follows = getattr(self.policy, "rule", "") != "reserve" or getattr(self.policy, "reserve", 0.0) < 1.0
        self._follow_kv = follows
        self._schedule_due = False
        self.trajs: list[_Trajectory] = []
        self.events: list[tuple[float, int, str, int]] = []  # (time, tie-break, kind, index)
        self._seq = 0
        self._calls: dict[int, Callable[[], None]] = {}
        self._call_ids = itertools.count()
        self.tool_returns: list[list[float]] = [[] for _ in self.engines]  # per engine: pending tool results
        self.round_tools: list[list[_Trajectory]] = [
            [] for _ in self.engines
        ]  # sync_turns: this turn's calls
        self.now = 0.0
        self.generated = 0
        self.paused_until = 0.0
        self.on_start: Callable[[int], None] | None = None
        self.on_finish: Callable[[int, float], None] | None = None

    def submit(self, spec: TrajectorySpec) -> int:
        """Queue one trajectory now; returns its index."""
        if spec.length > min(self.max_len, self.model.kv_tokens):
            raise ValueError(
                f"a trajectory of {spec.length} tokens exceeds L={self.max_len} or the KV cache ({self.model.kv_tokens})"
            )
        traj = _Trajectory(len(self.trajs), spec)
        traj.ready_at = self.now
        self.trajs.append(traj)
        e = self.policy.submit(traj, spec.group, self.max_len)
        if e is not None:
            self._start(traj, e, self.now)
        elif self._programs and not self._schedule_due:
            # A program-level policy orders everything submitted at one instant together (a burst).
            self._schedule_due = True
            self.at(self.now, self._schedule)
        return traj.index

    def _schedule(self) -> None:
        self._schedule_due = False
        self._place(self.policy.schedule(), self.now)

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Call fn at simulated time t."""
        call = next(self._call_ids)
        self._calls[call] = fn
        self._push(t, "call", call)

    def pause(self, seconds: float) -> None:
        """All engines stop decoding for `seconds` from now, then re-prefill their running requests."""
        self.paused_until = max(self.paused_until, self.now + seconds)
        for eng in self.engines:
            eng.pending_prefill += sum(r.traj.context for r in eng.running)
            eng.recomputed += sum(r.traj.context for r in eng.running)

    def _push(self, t: float, kind: str, index: int) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, index))

    def _start(self, traj: _Trajectory, e: int, t: float) -> None:
        if self.on_start is not None:
            self.on_start(traj.index)
        traj.engine = e
        first = _Request(traj, traj.spec.prompt_tokens, traj.spec.turn_tokens[0], traj.ready_at)
        self.engines[e].waiting.append(first)
        self._wake(e, t)

    def _next_turn(self, traj: _Trajectory, e: int, t: float) -> None:
        """Queue a trajectory's next turn on engine e (a move leaves its kept context behind)."""
        if e != traj.engine:
            old = self.engines[traj.engine]
            old.account(t)
            old.drop_prefix(traj)
            traj.engine = e
        spec = traj.spec
        req = _Request(traj, spec.tool_tokens[traj.turn - 1], spec.turn_tokens[traj.turn], traj.ready_at)
        self.engines[e].waiting.append(req)
        self._wake(e, t)

    def _place(self, placed: Placed, t: float) -> None:
        for traj, e in placed:
            if traj.turn == 0:
                self._start(traj, e, t)
            else:
                self._next_turn(traj, e, t)

    def _wake(self, e: int, t: float) -> None:
        if not self.engines[e].awake:
            self.engines[e].awake = True
            self._push(t, "engine", e)

    def _next_tool_return(self, e: int, now: float) -> float:
        pending = self.tool_returns[e]
        while pending and pending[0] <= now:
            heapq.heappop(pending)
        return pending[0] if pending else math.inf

    def run(self) -> None:
        """Process events until none is left."""
        while self.events:
            self.now, _, kind, index = heapq.heappop(self.events)
            if kind == "call":
                self._calls.pop(index)()
            elif kind == "tool":  # tool result is back: the next turn queues on the trajectory's engine
                traj = self.trajs[index]
                traj.ready_at = self.now
                if self._programs:  # ... or where and when the program-level policy says
                    self._place(self.policy.tool_returned(traj), self.now)
                else:
                    self._next_turn(traj, traj.engine, self.now)
            elif self.now < self.paused_until:  # a weight sync holds the engine
                self._push(self.paused_until, "engine", index)
            else:
                self._engine_step(index)

    def _engine_step(self, index: int) -> None:
        eng, now = self.engines[index], self.now
        eng.account(now)
        duration, finished = eng.step(now, self._next_tool_return(index, now))
        if duration == 0.0:
            eng.awake = False
            if self.round_tools[index]:  # the batch ended its turn: run its tool calls, wait for the slowest
                back = now + max(t.spec.tool_latency_s[t.turn - 1] for t in self.round_tools[index])
                for traj in self.round_tools[index]:
                    self._push(back, "tool", traj.index)
                self.round_tools[index].clear()
            return
        end = now + duration
        self._push(end, "engine", index)
        if self._follow_kv:  # the scheduler follows each trajectory's real KV
            for req in eng.running + finished:
                self.policy.observe(req.traj, req.traj.context)
        for req in finished:
            traj = req.traj
            self.generated += traj.spec.turn_tokens[traj.turn]
            traj.turn += 1
            if traj.turn < len(traj.spec.turn_tokens):
                eng.keep_prefix(traj)
                if self._programs:
                    self._place(self.policy.tool_started(traj), end)
                if self.sync_turns:
                    self.round_tools[index].append(traj)
                    continue
                back = end + traj.spec.tool_latency_s[traj.turn - 1]
                self._push(back, "tool", traj.index)
                heapq.heappush(self.tool_returns[index], back)
            else:
                traj.finished_at = end
                self._place(self.policy.release(traj), end)
                if self.on_finish is not None:
                    self.at(end, lambda i=traj.index, t=end: self.on_finish(i, t))

    def busy_seconds(self) -> float:
        return sum(e.busy_s for e in self.engines)

    def result(self) -> SimResult:
        makespan = self.now
        busy = self.busy_seconds()
        n = len(self.engines)
        for eng in self.engines:
            eng.account(makespan)
        kv_capacity = makespan * n * self.model.kv_tokens
        return SimResult(
            mode=self.mode,
            makespan_s=makespan,
            preemptions=sum(e.preemptions for e in self.engines),
            recomputed_tokens=sum(e.recomputed for e in self.engines),
            generated_tokens=self.generated,
            utilization=busy / (makespan * n) if makespan else 0.0,
            mean_batch=sum(e.batch_time for e in self.engines) / busy if busy else 0.0,
            kv_running=sum(e.kv_seconds for e in self.engines) / kv_capacity if kv_capacity else 0.0,
            kv_held=sum(e.held_seconds for e in self.engines) / kv_capacity if kv_capacity else 0.0,
            waits_s=tuple(t.wait_s for t in self.trajs),
            finish_s=tuple(t.finished_at for t in self.trajs),
        )
