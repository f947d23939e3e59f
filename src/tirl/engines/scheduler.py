"""The KV-cache-aware rollout scheduler (rStar2-Agent, section 5: load-balanced rollout scheduling).

Static assignment (verl v0.2) hands every engine N/E trajectories up front, whole prompt groups at a
time. Long-tailed multi-turn trajectories then leave some engines idle while others overflow their
KV cache, evict in-flight requests and recompute them. The dynamic scheduler instead hands a
trajectory to an engine only while the engine's KV budget can hold it at its maximum length L,
hands out the next one the moment a trajectory finishes, keeps all turns of a trajectory on its
engine and sends the rollouts of one prompt's group to the same engine (shared prompt prefix).

Two reservation rules (what a placed trajectory counts against its engine's KV budget):
- rule="reserve" (default): max(reserve * L, its real context). reserve=1.0 reserves the full L
  for the trajectory's whole life (K_e = budget // L, never a preemption); reserve < 1 admits more
  when most trajectories end well before L, and still stops admitting as their real KV grows.
- rule="free_kv": the paper's literal rule. At each hand-out K_e = (engine's free KV) // L: a fresh
  trajectory counts L until it starts, then only the KV it really holds. Engines stay fuller, but
  nothing stops the running trajectories from outgrowing the cache afterwards (preemptions).
benchmarks/scheduler_sim.py measures them side by side: against static with vLLM's own in-engine
admission (full caches, many preemptions) dynamic is at par, 0.9-1.15x with reserve=0.7 and no
preemptions; against turn-synchronous static it is 1.3-3x faster.

`Admission` is the placement policy alone (no clock, no asyncio), shared by `RolloutScheduler`
and the discrete-event simulator (benchmarks/rollout_sim.py).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from tirl.engines.base import Engine, Generation, SamplingParams

Mode = Literal["dynamic", "static"]
MODES: tuple[Mode, ...] = ("dynamic", "static")
Rule = Literal["reserve", "free_kv"]
RULES: tuple[Rule, ...] = ("reserve", "free_kv")
Ticket = TypeVar("Ticket")


@dataclass
class EngineSlots:
    """What the policy knows about one engine."""

    budget: int | None = None  # KV tokens it may fill (its free tokens when idle); None: unknown
    reserved: int = 0  # sum of the reservations of trajectories placed on it
    active: int = 0  # trajectories placed on it
    paused: int = 0  # of which paused at a tool call (they reserve nothing until they resume)

    def fits(self, tokens: int) -> bool:
        # An engine running nothing always takes one trajectory, even one longer than its cache
        # (no deadlock).
        return self.active == self.paused or self.budget is None or self.reserved + tokens <= self.budget

    def over(self) -> bool:
        return self.budget is not None and self.reserved > self.budget

    def headroom(self) -> float:
        return float("inf") if self.budget is None else self.budget - self.reserved


@dataclass
class _Placement:
    engine: int
    floor: int  # the reservation never drops below this (reserve * L; free_kv: L until it starts, then 0)
    reservation: int
    context: int = 0  # KV tokens it holds (last observed)
    paused: bool = False  # held back at a tool call: it reserves nothing until it resumes


class Admission(Generic[Ticket]):
    """The placement policy: which engine a trajectory goes to, or a FIFO wait for finishing ones.

    rule="reserve": a placed trajectory reserves max(its current context, reserve * L) KV tokens of
    the engine's budget (reserve=1.0: K_e = budget // L, never a preemption). rule="free_kv": the
    paper's K_e = free KV // L at each hand-out (a fresh trajectory counts L, a started one its
    real context). Real growth is reported through `observe`.

    Static mode hands whole groups to engines round-robin (verl's N/E chunks of the group-ordered
    batch), with no capacity check: the engine's own queue absorbs the overflow.

    Callers submit a hashable ticket (a future, a simulated trajectory) and get an engine index, or
    None when it was queued; `release` returns the queued tickets it could place. `budget_of(engine)`
    is asked for an idle engine's free KV tokens before placing (it then holds nothing of ours).

    pause=True (dynamic mode; ThunderAgent's idea, arXiv 2602.13692, with tirl's order): callers also
    report each turn's end (`tool_started`) and the tool's return (`tool_returned`). When the real
    contexts on an engine outgrow its budget (reserve < 1, free_kv), trajectories waiting on a tool
    are paused, smallest context first (the cheapest to re-prefill; the long ones, which end the
    step, keep going), instead of letting the engine preempt running ones: a paused
    trajectory reserves nothing (its KV is the engine's evictable prefix cache) and its next turn
    waits until there is room again, ahead of every new trajectory: on its engine (where the
    prefix may still be cached), else where there is most room. Admission stays FIFO, group by group, so a
    GRPO group's members move together; ThunderAgent's smallest-first order starves long prompts.
    With reserve=1.0 no engine is ever over its budget: nothing pauses.

    group_affinity=False (dynamic mode) places every trajectory where there is most room instead of
    on its group's engine: a group's rollouts share a prompt prefix but also its difficulty, and with
    a small reservation a whole hard group on one engine makes the step's tail
    (benchmarks/scheduler_sim.py --programs: 284 s against 388 s at the paper's layout).
    """

    def __init__(
        self,
        n_engines: int,
        mode: Mode = "dynamic",
        budget_of: Callable[[int], int | None] | None = None,
        reserve: float = 1.0,
        rule: Rule = "reserve",
        group_memory: int = 4096,
        pause: bool = False,
        group_affinity: bool = True,
    ):
        if n_engines < 1:
            raise ValueError(f"the scheduler needs at least one engine, got {n_engines}")
        if mode not in MODES:
            raise ValueError(f"unknown scheduler mode {mode!r}: use one of {MODES}")
        if not 0.0 < reserve <= 1.0:
            raise ValueError(f"reserve={reserve}: the share of L reserved per trajectory must be in (0, 1]")
        if rule not in RULES:
            raise ValueError(f"unknown reservation rule {rule!r}: use one of {RULES}")
        self.mode = mode
        self.reserve = reserve
        self.rule = rule
        self.slots = [EngineSlots() for _ in range(n_engines)]
        self.queue: deque[tuple[Ticket, str, int]] = deque()
        self._placed: dict[Ticket, _Placement] = {}
        self._budget_of = budget_of
        self._round_robin = itertools.cycle(range(n_engines))
        self._group_engine: OrderedDict[str, int] = OrderedDict()  # LRU: group -> engine holding its prefix
        self._group_memory = group_memory
        self.pause = pause and mode == "dynamic"
        self.group_affinity = group_affinity
        self.pauses = 0
        self._in_tool: list[dict[Ticket, None]] = [{} for _ in range(n_engines)]  # unpaused, in a tool call
        self._resumes: deque[Ticket] = deque()  # paused, their tool returned: they go before new ones

    @property
    def program_level(self) -> bool:
        """Whether callers must report tool boundaries (and hold a paused trajectory's next turn)."""
        return self.pause

    def set_budget(self, engine: int, free_tokens: int | None) -> None:
        self.slots[engine].budget = free_tokens

    def submit(self, ticket: Ticket, group: str, max_tokens: int) -> int | None:
        """Place now (engine index) or queue behind earlier tickets (None): nobody overtakes."""
        if not self.queue and not self._resumes:  # paused trajectories go first
            engine = self._place(ticket, group, max_tokens)
            if engine is not None:
                return engine
        self.queue.append((ticket, group, max_tokens))
        return None

    def withdraw(self, ticket: Ticket) -> bool:
        """Drop a queued ticket (its trajectory was cancelled); False if it was not queued."""
        for entry in self.queue:
            if entry[0] is ticket:
                self.queue.remove(entry)
                return True
        return False

    def observe(self, ticket: Ticket, context_tokens: int) -> None:
        """A placed trajectory's context (KV it holds) grew: its reservation follows once past the floor."""
        placement = self._placed[ticket]
        placement.context = context_tokens
        if self.rule == "free_kv":
            placement.floor = 0  # started: the engine's free KV now reflects what it really holds
        if placement.paused:
            return
        reservation = max(placement.floor, context_tokens)
        self.slots[placement.engine].reserved += reservation - placement.reservation
        placement.reservation = reservation
        if self.pause:
            self._relieve(placement.engine)

    def tool_started(self, ticket: Ticket) -> list[tuple[Ticket, int]]:
        """Its turn ended: on an over-full engine the youngest trajectories in tool calls pause.

        Returns the tickets placed or resumed meanwhile (ticket, engine)."""
        placement = self._placed[ticket]
        if not self.pause or placement.paused:
            return []
        self._in_tool[placement.engine][ticket] = None
        self._relieve(placement.engine)
        return self._drain()

    def tool_returned(self, ticket: Ticket) -> list[tuple[Ticket, int]]:
        """Its tool call returned: it goes on (it is among the tickets returned) or waits to resume."""
        placement = self._placed[ticket]
        self._in_tool[placement.engine].pop(ticket, None)
        if not placement.paused:
            return [(ticket, placement.engine)]
        self._resumes.append(ticket)
        return self._drain()

    def schedule(self) -> list[tuple[Ticket, int]]:
        """Place what fits now: paused trajectories first, then queued ones in order."""
        return self._drain()

    def release(self, ticket: Ticket) -> list[tuple[Ticket, int]]:
        """A trajectory finished: free its room and place queued tickets, in order, while they fit."""
        placement = self._placed.pop(ticket)
        slot = self.slots[placement.engine]
        slot.reserved -= placement.reservation
        slot.active -= 1
        self._in_tool[placement.engine].pop(ticket, None)
        if placement.paused:
            slot.paused -= 1
            if ticket in self._resumes:
                self._resumes.remove(ticket)
        return self._drain()

    def _drain(self) -> list[tuple[Ticket, int]]:
        placed = self._resume()
        while self.queue and not self._resumes:
            waiting, group, tokens = self.queue[0]
            target = self._place(waiting, group, tokens)
            if target is None:
                break
            self.queue.popleft()
            placed.append((waiting, target))
        return placed

    def _resume(self) -> list[tuple[Ticket, int]]:
        """Resume paused trajectories in the order their tools returned, while the next one fits:
        on its engine (its prefix may still be cached there), else where there is most room (every
        turn sends its whole context, so another engine re-prefills it)."""
        resumed = []
        while self._resumes:
            placement = self._placed[self._resumes[0]]
            tokens = max(placement.floor, placement.context)
            engine = placement.engine
            if not self.slots[engine].fits(tokens):
                fitting = [e for e, s in enumerate(self.slots) if s.fits(tokens)]
                if not fitting:
                    break
                engine = max(fitting, key=lambda e: (self.slots[e].headroom(), -self.slots[e].active))
            ticket = self._resumes.popleft()
            self._move(placement, engine)
            placement.paused, placement.reservation = False, tokens
            self.slots[engine].reserved += tokens
            resumed.append((ticket, engine))
        return resumed

    def _move(self, placement: _Placement, engine: int) -> None:
        old = self.slots[placement.engine]
        old.active -= 1
        old.paused -= 1
        self.slots[engine].active += 1
        placement.engine = engine

    def _relieve(self, engine: int) -> None:
        """Pause the engine's trajectories in tool calls, smallest context first, until it is within
        its budget (running ones go on: the engine would preempt them, recomputing more)."""
        slot, in_tool = self.slots[engine], self._in_tool[engine]
        while slot.over() and in_tool:
            victim = min(in_tool, key=lambda t: self._placed[t].context)
            del in_tool[victim]
            placement = self._placed[victim]
            slot.reserved -= placement.reservation
            placement.paused, placement.reservation = True, 0
            slot.paused += 1
            self.pauses += 1

    def holds(self, ticket: Ticket) -> bool:
        return ticket in self._placed

    def engine_of(self, ticket: Ticket) -> int:
        return self._placed[ticket].engine

    def max_trajectories(self, engine: int, max_tokens: int) -> int | None:
        """K_e: how many fresh trajectories of length L the engine takes at once (None: unknown)."""
        budget = self.slots[engine].budget
        return None if budget is None else max(1, budget // self._floor(max_tokens))

    def _floor(self, max_tokens: int) -> int:
        share = 1.0 if self.rule == "free_kv" else self.reserve
        return max(1, math.ceil(share * max_tokens))

    def _place(self, ticket: Ticket, group: str, max_tokens: int) -> int | None:
        floor = self._floor(max_tokens)
        if self.mode == "static":  # whole groups round-robin; no capacity check
            home = self._group_engine.get(group)
            engine = home if home is not None else next(self._round_robin)
        else:
            self._refresh_idle_budgets()
            engine = self._choose(group, floor)
            if engine is None:
                return None
        slot = self.slots[engine]
        slot.reserved += floor
        slot.active += 1
        self._placed[ticket] = _Placement(engine, floor, floor)
        self._remember(group, engine)
        return engine

    def _refresh_idle_budgets(self) -> None:
        if self._budget_of is None:
            return
        for e, slot in enumerate(self.slots):
            if slot.active == 0:
                slot.budget = self._budget_of(e)

    def _choose(self, group: str, tokens: int) -> int | None:
        home = self._group_engine.get(group) if self.group_affinity else None
        if home is not None and self.slots[home].fits(tokens):
            return home
        fitting = [e for e, s in enumerate(self.slots) if s.fits(tokens)]
        if not fitting:
            return None
        # Most free room first; among equals the least loaded (spreads groups over idle engines).
        return max(fitting, key=lambda e: (self.slots[e].headroom(), -self.slots[e].active))

    def _remember(self, group: str, engine: int) -> None:
        self._group_engine[group] = engine
        self._group_engine.move_to_end(group)
        while len(self._group_engine) > self._group_memory:
            self._group_engine.popitem(last=False)


@dataclass
class _EngineMetrics:
    busy_s: float = 0.0  # time with at least one trajectory in flight
    busy_since: float | None = None
    leases: int = 0
    peak_in_flight: int = 0
    preemptions_at_reset: int = 0


class _LeasedEngine:
    """The engine a trajectory leased: forwards everything, reports the trajectory's KV to the policy.

    With `turns` (the scheduler's pausing), a turn after the first first waits for the policy to let
    the trajectory go on (it may have been paused at its tool call, and may resume on another engine:
    every turn sends its whole context), and the end of each turn is reported.
    """

    def __init__(
        self,
        engine: Engine,
        on_context: Callable[[int], None],
        turns: tuple[Callable[[], Awaitable[Engine]], Callable[[], None]] | None = None,
    ):
        self._engine = engine
        self._on_context = on_context
        self._turns = turns
        self._first_turn = True

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if self._turns is not None and not self._first_turn:
            self._engine = await self._turns[0]()
        self._first_turn = False
        self._on_context(len(prompt_ids))
        generation = await self._engine.generate(prompt_ids, params)
        # The context stays cached for the next turn, so it keeps counting while the tool runs.
        self._on_context(len(prompt_ids) + len(generation.token_ids))
        if self._turns is not None:
            self._turns[1]()
        return generation

    def __getattr__(self, name: str) -> Any:  # capacity, load_weights, close, name, ...
        return getattr(self._engine, name)


class RolloutScheduler:
    """EnginePool over several engines; mode="dynamic" (KV-cache-aware) or "static" (round-robin).

    `reserve` and `rule` are Admission's: reserve=1.0 (full L per trajectory) never preempts.
    `pause` (dynamic mode): when real contexts outgrow an engine's budget (reserve < 1, free_kv),
    trajectories waiting on a tool are held back at their next turn until there is room (Admission).
    `group_affinity=False` spreads a group's rollouts by room instead of keeping them on one engine.
    """

    def __init__(
        self,
        engines: list[Engine],
        mode: Mode = "dynamic",
        reserve: float = 1.0,
        rule: Rule = "reserve",
        clock: Callable[[], float] = time.monotonic,
        pause: bool = True,
        group_affinity: bool = True,
    ):
        self.engines = list(engines)
        self.mode = mode
        self.policy: Admission[asyncio.Future[int]] = Admission(
            len(self.engines),
            mode,
            budget_of=lambda e: self.engines[e].capacity().free_tokens,
            reserve=reserve,
            rule=rule,
            pause=pause,
            group_affinity=group_affinity,
        )
        self._resuming: dict[asyncio.Future[int], asyncio.Future[int]] = {}  # paused ticket -> its wake-up
        self._clock = clock
        self.reset_metrics()

    # --- EnginePool ---------------------------------------------------------------------------------
    @asynccontextmanager
    async def lease(self, group: str, max_tokens: int) -> AsyncIterator[Engine]:
        if max_tokens < 1:
            raise ValueError(f"lease(max_tokens={max_tokens}): the trajectory length budget must be >= 1")
        ticket = await self._acquire(group, max_tokens)
        try:
            engine = self.engines[self.policy.engine_of(ticket)]
            turns = None
            if self.policy.program_level:
                turns = (
                    lambda: self._next_turn(ticket),
                    lambda: self._hand_out(self.policy.tool_started(ticket)),
                )
            yield _LeasedEngine(engine, lambda tokens: self.policy.observe(ticket, tokens), turns)
        finally:
            self._release(ticket)

    async def _next_turn(self, ticket: asyncio.Future[int]) -> Engine:
        """The trajectory's tool call returned: go on, or wait until the policy resumes it."""
        before = self.policy.engine_of(ticket)
        placed = self.policy.tool_returned(ticket)
        self._hand_out([(t, e) for t, e in placed if t is not ticket])
        if not any(t is ticket for t, _ in placed):
            wake: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            self._resuming[ticket] = wake
            try:
                await wake
            finally:
                self._resuming.pop(ticket, None)
        self._moved(before, self.policy.engine_of(ticket))
        return self.engines[self.policy.engine_of(ticket)]

    def _moved(self, before: int, after: int) -> None:
        if after != before:
            self._on_finish(before)
            self._on_start(after)

    async def _acquire(self, group: str, max_tokens: int) -> asyncio.Future[int]:
        if self._started is None:
            self._started = self._clock()
        ticket: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        engine = self.policy.submit(ticket, group, max_tokens)
        if engine is not None:
            ticket.set_result(engine)  # every leased ticket is done: a placed one later resumes
            self._on_start(engine)
            return ticket
        try:
            await ticket
        except asyncio.CancelledError:
            if not self.policy.withdraw(ticket) and self.policy.holds(ticket):
                self._release(ticket)  # placed just as it was cancelled
            raise
        return ticket

    def _release(self, ticket: asyncio.Future[int]) -> None:
        engine = self.policy.engine_of(ticket)
        placed = self.policy.release(ticket)
        self._on_finish(engine)
        self._hand_out(placed)

    def _hand_out(self, placed: list[tuple[asyncio.Future[int], int]]) -> None:
        """Wake the trajectories the policy placed: queued ones start, paused ones resume."""
        for waiting, target in placed:
            if waiting.done() and not waiting.cancelled():  # a leased trajectory resumes
                wake = self._resuming.get(waiting)
                if wake is not None and not wake.done():
                    wake.set_result(target)
                continue
            self._on_start(target)
            if waiting.done():  # cancelled while queued: hand its room on
                self._release(waiting)
            else:
                waiting.set_result(target)

    def _on_start(self, engine: int) -> None:
        m = self._metrics[engine]
        m.leases += 1
        m.peak_in_flight = max(m.peak_in_flight, self.policy.slots[engine].active)
        if m.busy_since is None:
            m.busy_since = self._clock()

    def _on_finish(self, engine: int) -> None:
        now = self._clock()
        m = self._metrics[engine]
        if self.policy.slots[engine].active == 0 and m.busy_since is not None:
            m.busy_s += now - m.busy_since
            m.busy_since = None
        self._finished = now

    # --- metrics ------------------------------------------------------------------------------------
    def reset_metrics(self) -> None:
        """Start a new measurement window (e.g. one RL step's rollout phase)."""
        self._metrics = [_EngineMetrics(preemptions_at_reset=e.capacity().preemptions) for e in self.engines]
        now = self._clock()
        for m, slot in zip(self._metrics, self.policy.slots, strict=True):
            m.busy_since = now if slot.active else None
        self._started: float | None = None
        self._finished: float | None = None

    def metrics(self) -> dict[str, Any]:
        """Makespan, per-engine busy/idle time, in-flight trajectories, KV usage and preemptions."""
        now = self._clock()
        start = self._started if self._started is not None else now
        end = (
            now if self.policy.queue or any(s.active for s in self.policy.slots) else (self._finished or now)
        )
        makespan = max(0.0, end - start)
        engines = []
        for e, (engine, m, slot) in enumerate(
            zip(self.engines, self._metrics, self.policy.slots, strict=True)
        ):
            cap = engine.capacity()
            busy = m.busy_s + (now - m.busy_since if m.busy_since is not None else 0.0)
            usage = None
            if cap.total_tokens and cap.free_tokens is not None:
                usage = 1.0 - cap.free_tokens / cap.total_tokens
            engines.append(
                {
                    "engine": getattr(engine, "name", str(e)),
                    "busy_s": busy,
                    "idle_s": max(0.0, makespan - busy),
                    "in_flight": slot.active,
                    "peak_in_flight": m.peak_in_flight,
                    "leases": m.leases,
                    "kv_budget_tokens": slot.budget,
                    "kv_usage": usage,
                    "preemptions": cap.preemptions - m.preemptions_at_reset,
                }
            )
        return {
            "mode": self.mode,
            "makespan_s": makespan,
            "waiting": len(self.policy.queue),
            "in_flight": sum(s.active for s in self.policy.slots),
            "preemptions": sum(e["preemptions"] for e in engines),
            "engines": engines,
        }
