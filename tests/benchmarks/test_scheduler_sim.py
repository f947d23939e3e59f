"""The scheduler simulator's policies: ThunderAgent's program-level scheduler, its group-first variant,
tirl's pausing Admission in the simulator, the sandbox latency distribution and the wait statistics."""

from __future__ import annotations

import math
import random
import statistics
from types import SimpleNamespace

from rollout_sim import EngineModel, TrajectorySpec, Workload, simulate
from scheduler_sim import (
    BUFFER_PER_PROGRAM,
    SANDBOX_LATENCY_MS,
    SANDBOX_MEAN_S,
    ProgramScheduler,
    compare_policies,
    sandbox_latency,
    wait_stats,
)
from tirl.engines.scheduler import Admission


def _programs(order: str, capacity: int, engines: int = 1) -> ProgramScheduler:
    return ProgramScheduler(engines, capacity, order, size=lambda t: t.tokens)  # type: ignore[arg-type]


class _Ticket:
    """A program as the policy sees it: hashable by identity, its size read through `size`."""

    def __init__(self, name: str, tokens: int):
        self.name, self.tokens = name, tokens


def test_sandbox_latency_follows_the_measured_quantiles():
    draw = sandbox_latency()
    xs = sorted(draw(random.Random(i)) * 1000 for i in range(4000))
    assert SANDBOX_LATENCY_MS[0] <= xs[0] and xs[-1] <= SANDBOX_LATENCY_MS[-1]
    assert abs(statistics.median(xs) - 21.8) < 1.5  # the measured median
    assert abs(statistics.mean(xs) / 1000 - SANDBOX_MEAN_S) < 0.003
    assert sandbox_latency(10.0)(random.Random(0)) == 10 * draw(random.Random(0))


def test_smallest_first_admits_short_prompts_before_a_long_one():
    policy = _programs("smallest", capacity=3_000)
    long, short = _Ticket("long", 2_000), [_Ticket(f"s{i}", 400) for i in range(4)]
    for i, t in enumerate([long, *short]):
        assert policy.submit(t, f"g{i}", 8_192) is None  # placed by `schedule`, burst by burst
    placed = policy.schedule()
    assert [t.name for t, _ in placed] == ["s0", "s1", "s2", "s3"]  # 4 x 500 = 2000; 2100 more > 3000
    assert policy.load[0] == 4 * (400 + BUFFER_PER_PROGRAM)
    assert policy.release(short[0]) == [] == policy.release(short[1])  # 1000 + 2100 > 3000
    assert policy.release(short[2]) == [(long, 0)]  # the long prompt goes last


def test_group_first_admits_in_group_order_whatever_the_size():
    policy = _programs("group", capacity=3_000)
    tickets = [_Ticket("a-long", 2_000), _Ticket("b1", 400), _Ticket("a2", 2_000), _Ticket("b2", 400)]
    for t in tickets:
        policy.submit(t, t.name[0], 8_192)
    assert [t.name for t, _ in policy.schedule()] == ["a-long"]  # then a2 does not fit: nobody overtakes
    assert [t.name for t, _ in policy.release(tickets[0])] == ["a2", "b1"]  # group a's members first
    assert [t.name for t, _ in policy.release(tickets[2])] == ["b2"]


def test_over_capacity_pauses_the_smallest_program_in_a_tool_call_and_resumes_it_elsewhere():
    policy = _programs("smallest", capacity=2_000, engines=2)
    a, b, c = _Ticket("a", 300), _Ticket("b", 200), _Ticket("c", 100)
    for t in (a, b, c):
        policy.submit(t, "g", 8_192)
    placed = dict((t.name, e) for t, e in policy.schedule())
    assert placed == {"c": 0, "b": 1, "a": 0}  # each on the emptiest engine
    policy.observe(c, 500)
    assert policy.tool_started(c) == []  # c waits on a tool on engine 0 ...
    policy.observe(a, 1_500)  # ... and a grows: 500 + 1500 + 2 buffers > 2000
    assert policy.pauses == 1 and policy.programs[c].engine is None
    assert policy.tool_returned(c) == [(c, 1)]  # its engine is full: it resumes on engine 1
    assert policy.programs[c].last_engine == 0 and policy.load[1] == 200 + 500 + 2 * BUFFER_PER_PROGRAM


def test_a_reasoning_program_on_an_over_full_engine_pauses_at_its_next_tool_call():
    policy = _programs("group", capacity=1_000)
    a, b = _Ticket("a", 100), _Ticket("b", 100)
    for t in (a, b):
        policy.submit(t, "g", 8_192)
    assert len(policy.schedule()) == 2
    policy.observe(a, 500)
    policy.observe(b, 500)  # 1200 > 1000, nobody in a tool call: b (the younger) is marked
    assert policy.programs[b].marked and policy.marked[0] == 500 and policy.pauses == 0
    policy.observe(b, 600)  # its growth is counted as already gone: no more marks
    assert not policy.programs[a].marked and policy.marked[0] == 600
    assert policy.tool_started(b) == [] and policy.pauses == 1 and policy.load[0] == 600
    assert policy.tool_returned(b) == []  # 600 + 700 > 1000: it waits for room
    assert policy.release(a) == [(b, 0)]


def test_unknown_order_is_refused():
    try:
        _programs("largest", capacity=1)
    except ValueError as e:
        assert "largest" in str(e)
    else:
        raise AssertionError("an unknown order was accepted")


def _tight_workload() -> list[TrajectorySpec]:
    shape = Workload(
        "tight",
        turn_tokens=lambda r: r.lognormvariate(math.log(300), 1.0),
        tool_latency_s=sandbox_latency(),
        prompts=12,
        group_size=4,
        max_len=2048,
        mean_turns=3.0,
        difficulty_sigma=0.8,
        prompt_tokens=lambda r: r.lognormvariate(math.log(100), 1.0),
    )
    return shape.sample(seed=2)


def test_every_policy_generates_the_same_tokens_and_reports_waits_and_kv():
    specs = _tight_workload()
    engine = EngineModel(kv_tokens=6_000, max_seqs=64)
    rows = compare_policies(specs, 2, engine, 2048)
    expected = sum(sum(s.turn_tokens) for s in specs)
    assert [r.name.split()[0] for r in rows] == ["tirl"] * 4 + ["ThunderAgent", "group-aware"]
    for row in rows:
        r = row.result
        assert r.generated_tokens == expected and len(r.waits_s) == len(r.finish_s) == len(specs)
        assert max(r.finish_s) == r.makespan_s and 0 < r.kv_running <= r.kv_held <= 1
        assert row.worst_wait_s == max(r.waits_s) >= max(row.longest_wait_s, row.slowest_group_wait_s)
    default, no_pause, small_floor, thunder = rows[0], rows[1], rows[3], rows[4]
    assert default.pauses == 0 and default.result.preemptions == 0 and no_pause.pauses == 0
    assert thunder.pauses > 0 and small_floor.pauses > 0  # the cache is tight: programs are paused
    assert small_floor.result.makespan_s < default.result.makespan_s  # more of them run at once


def test_wait_stats_picks_the_longest_prompt_and_the_last_group():
    specs = [
        TrajectorySpec("a", 100, [10], [], []),
        TrajectorySpec("a", 100, [10], [], []),
        TrajectorySpec("b", 900, [10], [], []),
    ]
    result = SimpleNamespace(waits_s=(1.0, 5.0, 2.0), finish_s=(9.0, 3.0, 4.0))
    assert wait_stats(specs, result) == (5.0, 2.0, 5.0)  # group a ends last; its longest wait is 5


def test_pausing_admission_in_the_simulator_recomputes_less_and_ends_sooner():
    specs = _tight_workload()
    engine = EngineModel(kv_tokens=6_000, max_seqs=64)
    runs = {}
    for pause in (False, True):
        policy = Admission(2, "dynamic", lambda e: engine.kv_tokens, reserve=0.1, pause=pause)
        runs[pause] = (simulate(specs, 2, engine, "dynamic", 2048, policy=policy), policy.pauses)
    (held, _), (paused, pauses) = runs[False], runs[True]
    assert pauses > 0 and paused.recomputed_tokens < held.recomputed_tokens
    assert paused.makespan_s < held.makespan_s
    assert paused.generated_tokens == held.generated_tokens
