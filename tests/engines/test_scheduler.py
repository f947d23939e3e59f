"""The KV-cache-aware rollout scheduler: placement policy, and leasing real (hf) engines."""

from __future__ import annotations

import asyncio

import pytest

from tirl.engines.base import EnginePool, Generation, KVCapacity, SamplingParams
from tirl.engines.config import EngineConfig
from tirl.engines.factory import build_pool
from tirl.engines.scheduler import Admission, RolloutScheduler

# --- the placement policy (pure) --------------------------------------------------------------------


def place(policy: Admission, group: str, max_tokens: int) -> int | None:
    return policy.submit(object(), group, max_tokens)


def test_dynamic_admits_k_per_engine_from_free_kv_then_queues_fifo():
    policy = Admission(2, "dynamic")
    policy.set_budget(0, 10_000)
    policy.set_budget(1, 6_000)
    assert policy.max_trajectories(0, 3_000) == 3 and policy.max_trajectories(1, 3_000) == 2
    placed = [place(policy, f"g{i}", 3_000) for i in range(5)]
    assert sorted(placed) == [0, 0, 0, 1, 1]
    first, second = "late-1", "late-2"
    assert policy.submit(first, "g9", 3_000) is None  # full: the trajectory waits
    assert policy.submit(second, "g8", 1_000) is None  # FIFO: no overtaking, though engine 0 has room
    # A finished trajectory frees room at once, for the queued tickets in order.
    on_engine_1 = next(t for t in policy._placed if policy.engine_of(t) == 1)
    assert policy.release(on_engine_1) == [(first, 1), (second, 0)] and not policy.queue


def test_reservation_follows_real_growth_above_the_floor():
    policy = Admission(1, "dynamic", reserve=0.25)
    policy.set_budget(0, 8_000)
    assert policy.max_trajectories(0, 4_000) == 8  # fresh trajectories reserve 1000 tokens each
    tickets = [f"t{i}" for i in range(8)]
    assert [policy.submit(t, "g", 4_000) for t in tickets] == [0] * 8
    assert policy.submit("t8", "g", 4_000) is None
    policy.observe("t0", 600)  # below the floor: still 1000 reserved
    assert policy.slots[0].reserved == 8_000
    policy.observe("t0", 3_000)  # it grew: the engine has less room ...
    policy.release("t1")
    assert policy.queue  # ... so a finished trajectory's 1000 tokens no longer admit the waiting one
    policy.release("t0")
    assert not policy.queue and policy.engine_of("t8") == 0
    # the floor rounds up, to one token at the least: a 1-token budget reserves 1 token, not 0 or 2
    tiny = Admission(1, "dynamic", reserve=0.25)
    tiny.set_budget(0, 10)
    assert tiny.submit("a", "g", 1) == 0 and tiny.submit("b", "g", 5) == 0
    assert tiny.slots[0].reserved == 1 + 2  # ceil(0.25 * 1) = 1, ceil(0.25 * 5) = 2


def test_withdrawn_ticket_is_not_placed():
    policy = Admission(1, "dynamic")
    policy.set_budget(0, 1_000)
    assert policy.submit("a", "a", 1_000) == 0
    assert policy.submit("gone", "b", 1_000) is None
    assert policy.withdraw("gone") and not policy.withdraw("gone")
    assert policy.release("a") == [] and policy.slots[0].reserved == 0


def test_idle_budget_comes_from_free_kv():
    free = {0: 4_000, 1: 9_000}
    policy = Admission(2, "dynamic", budget_of=free.__getitem__)
    assert place(policy, "g", 3_000) == 1  # engine 1 has the most free KV
    free[0] = 0  # something else filled engine 0: it still takes one (idle), then no more
    assert [place(policy, f"h{i}", 3_000) for i in range(3)] == [1, 1, 0]
    assert place(policy, "x", 3_000) is None


def test_group_prefers_its_engine_while_it_has_room():
    policy = Admission(3, "dynamic")
    for e in range(3):
        policy.set_budget(e, 8_000)
    first = place(policy, "prompt-a", 2_000)
    assert [place(policy, "prompt-a", 2_000) for _ in range(3)] == [first] * 3  # 4 x 2000 = budget
    assert place(policy, "prompt-a", 2_000) != first  # spills over only when the home engine is full
    assert place(policy, "prompt-b", 2_000) != first  # a new group goes where there is most room


def test_without_group_affinity_a_group_spreads_where_there_is_most_room():
    policy = Admission(3, "dynamic", group_affinity=False)
    for e in range(3):
        policy.set_budget(e, 8_000)
    assert [place(policy, "prompt-a", 2_000) for _ in range(4)] == [0, 1, 2, 0]
    pool = RolloutScheduler([_KVReporter("a", 1_000)], group_affinity=False)
    assert not pool.policy.group_affinity and pool.policy.pause


def test_a_queued_trajectory_placed_on_release_joins_its_group():
    policy = Admission(2, "dynamic")
    for e in range(2):
        policy.set_budget(e, 1_000)
    placed = [policy.submit(t, t[0], 500) for t in ("a1", "b1", "a2", "b2")]
    assert placed == [0, 1, 0, 1] and policy.submit("c1", "c", 500) is None
    assert policy.release("a1") == [("c1", 0)]
    for t in ("a2", "b1", "b2"):
        policy.release(t)
    assert policy.submit("c2", "c", 500) == 0  # its group's engine, though engine 1 has more room


def test_group_memory_forgets_the_least_recently_placed_group():
    policy = Admission(3, "static", group_memory=2)  # static: a remembered group goes home unconditionally
    assert [place(policy, g, 10) for g in ["a", "b", "a", "c"]] == [0, 1, 0, 2]
    assert list(policy._group_engine.items()) == [("a", 0), ("c", 2)]  # c evicted b (a was used since)
    assert place(policy, "b", 10) == 0  # forgotten: the round-robin's next engine, not its old home


def test_a_new_group_goes_where_there_is_most_free_room():
    policy = Admission(2, "dynamic")
    policy.set_budget(0, 10_000)
    policy.set_budget(1, 6_000)
    # headroom 10000 vs 6000, 7000 vs 6000, 4000 vs 6000, 4000 vs 3000
    assert [place(policy, f"g{i}", 3_000) for i in range(4)] == [0, 0, 1, 0]


def test_engines_that_cannot_report_their_kv_take_turns():
    """No budget known (a backend without KV figures): every engine fits, the least loaded goes first."""
    policy = Admission(3, "dynamic", budget_of=lambda e: None)
    assert [place(policy, f"g{i}", 10**6) for i in range(5)] == [0, 1, 2, 0, 1]
    assert policy.max_trajectories(0, 100) is None


def test_idle_engine_takes_one_trajectory_longer_than_its_cache():
    policy = Admission(1, "dynamic")
    policy.set_budget(0, 1_000)
    assert policy.max_trajectories(0, 5_000) == 1  # K_e is at least one
    assert place(policy, "g", 5_000) == 0
    assert place(policy, "g", 5_000) is None


def test_static_hands_whole_groups_round_robin_without_capacity_check():
    policy = Admission(3, "static")
    for e in range(3):
        policy.set_budget(e, 100)
    groups = ["a", "a", "b", "b", "c", "d", "a"]
    assert [place(policy, g, 10_000) for g in groups] == [0, 0, 1, 1, 2, 0, 0]


def test_free_kv_rule_counts_l_until_started_then_real_kv():
    """The paper's literal K = free KV // L at each hand-out: started trajectories count what they hold."""
    policy = Admission(1, "dynamic", rule="free_kv")
    policy.set_budget(0, 10_000)
    assert [policy.submit(t, "g", 4_000) for t in "abc"] == [0, 0, None]  # K = 10000 // 4000
    for t in "de":
        policy.submit(t, "g", 4_000)
    policy.observe("a", 500)  # started, holds 500 tokens: its L no longer counts
    assert policy.slots[0].reserved == 4_500
    # b finishes: free KV = 10000 - 500 = 9500 -> two fresh trajectories fit (K = 2), the third waits.
    assert policy.release("b") == [("c", 0), ("d", 0)] and list(t for t, *_ in policy.queue) == ["e"]


def test_bad_arguments_are_explained():
    with pytest.raises(ValueError, match="at least one engine"):
        Admission(0)
    with pytest.raises(ValueError, match="unknown scheduler mode"):
        Admission(2, "greedy")  # type: ignore[arg-type]
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match=f"reserve={share}: the share of L reserved"):
            Admission(2, reserve=share)
    with pytest.raises(ValueError, match="unknown reservation rule"):
        Admission(2, rule="greedy")  # type: ignore[arg-type]


# --- the scheduler over real engines ----------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_engines(tiny_model_dir):
    from tirl.engines.hf import HFEngine

    # KV capacity of an hf engine = max_batch_size x max_model_len = 2 x 256 = 512 tokens.
    cfg = EngineConfig(backend="hf", model=str(tiny_model_dir), max_batch_size=2, max_model_len=256)
    engines = [HFEngine(cfg, name=f"hf{i}") for i in range(2)]
    yield engines
    for e in engines:
        asyncio.run(e.close())


async def run_trajectories(pool: EnginePool, n: int, max_tokens: int, turns: int = 2):
    """n two-turn trajectories (a sleep stands in for the tool call); returns (engine names, peak)."""
    in_flight: dict[str, int] = {}
    peak: dict[str, int] = {}

    async def one(i: int) -> str:
        async with pool.lease(group=f"prompt{i // 2}", max_tokens=max_tokens) as engine:
            name = engine.name
            in_flight[name] = in_flight.get(name, 0) + 1
            peak[name] = max(peak.get(name, 0), in_flight[name])
            context = [1, 2, 3]
            for t in range(turns):
                gen = await engine.generate(context, SamplingParams(max_tokens=8, seed=i * 7 + t))
                context += gen.token_ids
                await asyncio.sleep(0.02)
            in_flight[name] -= 1
            return name

    names = await asyncio.gather(*(one(i) for i in range(n)))
    return names, peak


async def test_dynamic_scheduler_respects_kv_and_keeps_groups_together(hf_engines):
    pool = RolloutScheduler(hf_engines, mode="dynamic")
    names, peak = await run_trajectories(pool, n=8, max_tokens=200)  # K = 512 // 200 = 2 per engine
    assert peak == {"hf0": 2, "hf1": 2}
    assert names.count("hf0") + names.count("hf1") == 8
    # The two rollouts of each prompt placed at the start share one engine (room for both there).
    assert names[0] == names[1] != names[2] == names[3]
    m = pool.metrics()
    assert m["mode"] == "dynamic" and m["in_flight"] == 0 and m["waiting"] == 0
    # Which engine frees room first depends on timing; each got its first two and all 8 ran.
    assert sum(e["leases"] for e in m["engines"]) == 8 and min(e["leases"] for e in m["engines"]) >= 2
    for e in m["engines"]:
        assert 0 < e["busy_s"] <= m["makespan_s"] + 1e-6 and e["kv_budget_tokens"] == 512
    # what the trainer logs every step (Runtime.engine_metrics): the same numbers, flat, per engine
    from tirl.runtime import Runtime

    rt = Runtime(hf_engines, pool, executor=None, scorer=None, tokenizer=None)
    flat = rt.engine_metrics()
    leases = [e["leases"] for e in m["engines"]]  # 4 + 4 or 5 + 3: whichever engine freed room first
    assert [flat["rollout/leases/hf0"], flat["rollout/leases/hf1"], flat["rollout/preemptions"]] == [
        *leases,
        0,
    ]
    assert (
        flat["rollout/busy_s/hf0"] == m["engines"][0]["busy_s"]
        and flat["rollout/makespan_s"] == m["makespan_s"]
    )
    assert rt.engine_metrics()["rollout/leases/hf0"] == 0  # the next step's window starts empty


async def test_static_scheduler_overcommits_whole_groups_round_robin(hf_engines):
    pool = RolloutScheduler(hf_engines, mode="static")
    names, peak = await run_trajectories(pool, n=8, max_tokens=200)  # groups of 2
    assert names == ["hf0", "hf0", "hf1", "hf1"] * 2 and peak == {"hf0": 4, "hf1": 4}  # no capacity check


async def test_cancelled_waiter_leaves_no_reservation(hf_engines):
    pool = RolloutScheduler(hf_engines[:1], mode="dynamic")
    async with pool.lease("a", 400):
        waiter = asyncio.create_task(pool.lease("b", 400).__aenter__())
        await asyncio.sleep(0)  # one loop turn: the waiter submits its ticket and queues
        assert pool.metrics()["waiting"] == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not pool.policy.queue  # at once: a dead ticket must not hold up the queue behind it
    assert pool.metrics()["waiting"] == 0 and pool.policy.slots[0].reserved == 0 and not pool.policy.queue
    with pytest.raises(ValueError, match="max_tokens"):
        async with pool.lease("c", 0):
            pass


async def test_trajectory_cancelled_just_as_it_is_placed_releases_its_slot(hf_engines):
    pool = RolloutScheduler(hf_engines[:1], mode="dynamic")
    holder = pool.lease("a", 400)
    await holder.__aenter__()
    waiter = asyncio.create_task(pool.lease("b", 400).__aenter__())
    await asyncio.sleep(0)
    assert pool.metrics()["waiting"] == 1
    await holder.__aexit__(None, None, None)  # "a" finishes: "b" is placed on the engine ...
    assert (pool.metrics()["in_flight"], pool.metrics()["waiting"]) == (1, 0) and not waiter.done()
    waiter.cancel()  # ... and cancelled before it could run
    with pytest.raises(asyncio.CancelledError):
        await waiter
    slot = pool.policy.slots[0]
    assert (slot.active, slot.reserved, pool.metrics()["in_flight"]) == (0, 0, 0)
    async with pool.lease("c", 400):  # the room is free again: placed at once, not queued
        assert pool.metrics()["in_flight"] == 1 and pool.metrics()["waiting"] == 0


async def test_a_waiter_cancelled_as_room_frees_hands_the_room_on(hf_engines):
    pool = RolloutScheduler(hf_engines[:1], mode="dynamic")
    holder = pool.lease("a", 400)
    await holder.__aenter__()
    waiter = asyncio.create_task(pool.lease("b", 400).__aenter__())
    await asyncio.sleep(0)  # queued
    waiter.cancel()  # its ticket is cancelled; its own clean-up runs only at its next loop turn ...
    await holder.__aexit__(None, None, None)  # ... after "a" finished and placed it: the room is handed on
    with pytest.raises(asyncio.CancelledError):
        await waiter
    slot = pool.policy.slots[0]
    assert (slot.active, slot.reserved, pool.metrics()["waiting"], pool.metrics()["in_flight"]) == (
        0,
        0,
        0,
        0,
    )


async def test_growth_following_reserve_sees_the_context_the_engine_reports(hf_engines, tiny_model_dir):
    cfg = EngineConfig(
        backend="hf", model=str(tiny_model_dir), max_batch_size=2, max_model_len=256, scheduler_reserve=0.1
    )
    pool = build_pool(hf_engines, cfg)
    assert isinstance(pool, RolloutScheduler) and pool.policy.reserve == 0.1
    async with pool.lease("g", 200) as engine:  # reserves its floor, 0.1 x 200 tokens, until it grows
        slot = pool.policy.slots[pool.policy.engine_of(next(iter(pool.policy._placed)))]
        assert slot.reserved == 20
        context = list(range(1, 31))
        turn = asyncio.create_task(engine.generate(context, SamplingParams(max_tokens=8, seed=1)))
        await asyncio.sleep(0)  # the request is in the engine: its prompt is in the KV cache
        assert slot.reserved == 30
        gen = await turn
        assert gen.token_ids and slot.reserved == 30 + len(gen.token_ids)
        context += gen.token_ids + [7] * 12  # a tool response joins the context
        gen = await engine.generate(context, SamplingParams(max_tokens=8, seed=2))
        assert slot.reserved == len(context) + len(gen.token_ids)
    assert slot.reserved == 0 and slot.active == 0


class _Clock:
    """The scheduler's clock, advanced by hand: the metrics' arithmetic, without real time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _KVReporter:
    """An engine seen from the scheduler's metrics: a name and its KV cache (it generates nothing here)."""

    def __init__(self, name: str, total: int, preemptions: int = 0):
        self.name, self.total, self.free, self.preemptions = name, total, total, preemptions

    def capacity(self) -> KVCapacity:
        return KVCapacity(self.total, self.free, self.preemptions)


async def test_metrics_count_busy_idle_makespan_kv_and_preemptions_of_the_window():
    clock, a, b = _Clock(), _KVReporter("a", 1_000, preemptions=3), _KVReporter("b", 1_000)
    pool = RolloutScheduler([a, b], clock=clock)
    clock.now = 10.0  # the window starts with its first lease, not at reset
    first = pool.lease("g1", 600)
    assert await first.__aenter__() is not None and pool.policy.slots[0].active == 1  # a: tie, the first
    clock.now = 12.0
    second = pool.lease("g2", 600)
    await second.__aenter__()  # b: 600 more do not fit beside a's 600
    a.free, a.preemptions = 250, 5
    clock.now = 13.0
    m = pool.metrics()  # mid-window: whatever runs counts up to now
    assert (m["makespan_s"], m["in_flight"], m["waiting"], m["preemptions"]) == (3.0, 2, 0, 2)
    ma, mb = m["engines"]
    assert (ma["engine"], ma["busy_s"], ma["idle_s"], mb["busy_s"], mb["idle_s"]) == ("a", 3.0, 0.0, 1.0, 2.0)
    assert (ma["kv_usage"], mb["kv_usage"], ma["kv_budget_tokens"], ma["preemptions"]) == (
        0.75,
        0.0,
        1_000,
        2,
    )
    assert (ma["in_flight"], ma["peak_in_flight"], ma["leases"], mb["leases"]) == (1, 1, 1, 1)
    clock.now = 14.0
    await first.__aexit__(None, None, None)
    clock.now = 15.0
    assert pool.metrics()["makespan_s"] == 5.0  # b still runs: the window is still open
    clock.now = 17.0
    await second.__aexit__(None, None, None)
    clock.now = 30.0  # idle since 17: the makespan ends at the last finish
    m = pool.metrics()
    assert (m["makespan_s"], m["in_flight"]) == (7.0, 0)
    assert [(e["busy_s"], e["idle_s"], e["in_flight"]) for e in m["engines"]] == [
        (4.0, 3.0, 0),
        (5.0, 2.0, 0),
    ]
    a.free = 1_000
    async with pool.lease("g3", 600):  # a second busy period of a (both idle, a first): 30 to 32
        clock.now = 32.0
    m = pool.metrics()
    assert (m["makespan_s"], m["engines"][0]["busy_s"], m["engines"][0]["leases"]) == (22.0, 6.0, 2)
    pool.reset_metrics()  # the next window: nothing counted yet, preemptions from here on
    m = pool.metrics()
    assert (m["makespan_s"], m["preemptions"]) == (0.0, 0)
    assert [(e["busy_s"], e["leases"], e["peak_in_flight"]) for e in m["engines"]] == [(0.0, 0, 0)] * 2


class _Unnamed:
    """An engine with no name that knows its cache size but not what is free."""

    def capacity(self) -> KVCapacity:
        return KVCapacity(1_000, None)


def test_metrics_of_an_engine_without_a_name_or_free_kv():
    [m] = RolloutScheduler([_Unnamed()]).metrics()["engines"]
    assert (m["engine"], m["kv_usage"], m["kv_budget_tokens"]) == ("0", None, None)


async def test_the_scheduler_applies_its_reservation_rule():
    # free_kv counts a fresh trajectory at its full L whatever `reserve` says: K = 1000 // 600
    for rule, k in (("free_kv", 1), ("reserve", 3)):
        pool = RolloutScheduler([_KVReporter("a", 1_000)], reserve=0.5, rule=rule)
        async with pool.lease("g", 600):
            assert pool.policy.max_trajectories(0, 600) == k, rule


async def test_a_window_reset_mid_flight_counts_the_running_engine_from_the_reset():
    clock, a = _Clock(), _KVReporter("a", 1_000)
    pool = RolloutScheduler([a], clock=clock)
    running = pool.lease("g", 100)
    await running.__aenter__()
    clock.now = 5.0
    pool.reset_metrics()
    clock.now = 8.0
    assert pool.metrics()["engines"][0]["busy_s"] == 3.0  # from the reset, not from the lease
    await running.__aexit__(None, None, None)
    clock.now = 9.0
    assert pool.metrics()["engines"][0]["busy_s"] == 3.0


# --- pausing at tool calls (ThunderAgent's idea, tirl's order) ----------------------------------------


def _over_full_engine() -> Admission:
    """One engine of 8000 tokens, four trajectories placed at a 1000-token floor (reserve 0.25 x 4000)."""
    policy = Admission(1, "dynamic", reserve=0.25, pause=True)
    policy.set_budget(0, 8_000)
    assert [policy.submit(t, "g", 4_000) for t in ("a", "b", "c", "d")] == [0] * 4
    return policy


def test_without_pause_tool_boundaries_change_nothing():
    policy = Admission(1, "dynamic", reserve=0.25)
    policy.set_budget(0, 2_000)
    assert policy.submit("a", "g", 4_000) == 0 and not policy.program_level
    policy.observe("a", 3_000)  # over its budget: nobody pauses, the engine's own queue copes
    assert policy.tool_started("a") == [] and policy.tool_returned("a") == [("a", 0)]
    assert policy.pauses == 0 and policy.slots[0].reserved == 3_000
    assert not Admission(1, "static", pause=True).program_level  # static: the engine's queue copes


def test_an_over_full_engine_pauses_the_smallest_trajectory_in_a_tool_call():
    policy = _over_full_engine()
    assert policy.program_level
    for t, context in (("a", 3_000), ("b", 1_500), ("c", 1_200)):
        policy.observe(t, context)
        assert policy.tool_started(t) == []
    assert policy.pauses == 0 and policy.slots[0].reserved == 6_700  # 3000 + 1500 + 1200 + d's 1000
    policy.observe("d", 2_500)  # d, still generating, pushes the engine to 8200 > 8000
    assert policy.pauses == 1 and policy._placed["c"].paused  # c: the smallest context in a tool call
    assert policy.slots[0].reserved == 7_000 and policy.slots[0].paused == 1
    assert policy.tool_returned("b") == [("b", 0)]  # not paused: it goes on at once
    assert policy.tool_returned("c") == []  # paused: 7000 + 1200 > 8000, it waits
    assert policy.submit("e", "g", 4_000) is None  # nobody new goes before a paused trajectory
    # room again: c resumes first, at its real context, then the queue in order (5200 + 1000 <= 8000)
    assert policy.release("a") == [("c", 0), ("e", 0)]
    assert policy.slots[0].reserved == 4_000 + 1_200 + 1_000 and policy.slots[0].paused == 0
    assert policy.schedule() == []


def test_the_trajectory_whose_turn_ends_on_an_over_full_engine_pauses_itself():
    policy = _over_full_engine()
    policy.observe("a", 3_000)
    policy.observe("b", 3_500)
    policy.observe("c", 1_400)  # 3000 + 3500 + 1400 + 1000 = 8900: over, but nobody is in a tool call
    assert policy.pauses == 0
    assert policy.tool_started("c") == [] and policy._placed["c"].paused  # 7500 <= 8000 once it pauses
    assert policy.slots[0].reserved == 7_500 and policy.pauses == 1


def test_a_trajectory_back_from_its_tool_is_never_paused():
    policy = _over_full_engine()
    policy.observe("a", 1_000)
    assert policy.tool_started("a") == [] and policy.tool_returned("a") == [("a", 0)]  # it runs again
    policy.observe("b", 6_500)  # 1000 + 6500 + 2 x 1000 > 8000, and nobody is in a tool call now
    assert policy.pauses == 0 and not policy._placed["a"].paused
    assert policy.slots[0].reserved == 9_500  # over: the engine's own queue copes, as without pause


def test_a_trajectory_released_in_its_tool_call_is_never_a_pause_victim():
    policy = _over_full_engine()
    policy.observe("a", 1_000)
    policy.tool_started("a")
    policy.release("a")  # cancelled during its tool call
    policy.observe("b", 7_000)  # 7000 + 2 x 1000 > 8000, and nobody placed is in a tool call
    assert policy.pauses == 0 and policy.slots[0].reserved == 9_000


def _paused_on_engine_0(budgets: tuple[int, ...], others: str = "") -> Admission:
    """a, b, c on engine 0 (4000 tokens), then `others` (group h) where there is most room; a paused."""
    policy = Admission(len(budgets), "dynamic", reserve=0.25, pause=True)
    for engine, budget in enumerate(budgets):
        policy.set_budget(engine, budget)
    assert [policy.submit(t, "g", 4_000) for t in "abc"] == [0, 0, 0]
    for t in others:
        policy.submit(t, "h", 4_000)
    policy.observe("a", 1_500)
    policy.tool_started("a")
    policy.observe("b", 1_800)
    policy.observe("c", 1_000)  # 4300 > 4000: a pauses
    assert policy._placed["a"].paused
    return policy


def test_a_paused_trajectory_resumes_on_the_engine_with_most_room():
    policy = _paused_on_engine_0((4_000, 2_000, 3_000, 2_500))
    assert policy.tool_returned("a") == [("a", 2)]  # three others fit it: the one with most room


def test_between_engines_with_equal_room_a_resume_goes_to_the_less_loaded():
    policy = _paused_on_engine_0((4_000, 3_000, 2_000), others="d")
    assert policy.engine_of("d") == 1  # 3000 free: d reserves 1000 of it, leaving 2000 as engine 2 has
    assert policy.tool_returned("a") == [("a", 2)]  # 2000 each: engine 2 runs nothing


def test_a_paused_trajectory_resumes_where_there_is_room_when_its_engine_has_none():
    policy = _paused_on_engine_0((4_000, 2_000))
    assert policy._placed["a"].paused and policy.slots[0].reserved == 2_800
    assert policy.tool_returned("a") == [("a", 1)]  # no room at home: engine 1 re-prefills it
    assert policy.engine_of("a") == 1 and policy.slots[1].reserved == 1_500
    assert (policy.slots[0].active, policy.slots[1].active, policy.slots[0].paused) == (2, 1, 0)


def test_resumes_wait_in_order_and_an_engine_running_nothing_takes_the_next():
    policy = Admission(1, "dynamic", reserve=0.25, pause=True)
    policy.set_budget(0, 3_000)
    assert [policy.submit(t, "g", 4_000) for t in "abc"] == [0, 0, 0]
    for t, context in (("a", 1_000), ("b", 1_200)):
        policy.observe(t, context)
        policy.tool_started(t)  # b's: 1000 + 1200 + c's floor 1000 > 3000, a (the smaller) pauses
    policy.observe("c", 2_000)  # 1200 + 2000 > 3000: b pauses too
    assert policy._placed["a"].paused and policy._placed["b"].paused
    assert policy.tool_returned("b") == [] and policy.tool_returned("a") == []  # 2000 + 1200 > 3000
    assert policy.release("c") == [("b", 0), ("a", 0)]  # in the order their tools returned
    policy.observe("b", 2_900)
    policy.tool_started("b")  # 3900 > 3000: b pauses (the smaller, a, is not in a tool call)
    assert policy._placed["b"].paused and policy.tool_returned("b") == []
    policy.observe("a", 3_100)  # alone and over budget: a pauses at its tool call, the engine runs
    assert policy.tool_started("a") == [("b", 0)]  # nothing, so it takes b though 2900 + 3100 > 3000
    assert policy._placed["a"].paused and policy.tool_returned("a") == []
    assert policy.release("b") == [("a", 0)] and policy.slots[0].reserved == 3_100


def test_a_paused_trajectory_that_is_released_leaves_nothing_behind():
    policy = _over_full_engine()
    policy.observe("a", 2_000)
    policy.tool_started("a")
    policy.observe("b", 5_000)  # 2000 + 5000 + 2000 > 8000: a pauses
    assert policy._placed["a"].paused and policy.tool_returned("a") == []  # 7000 + 2000 > 8000
    assert policy.submit("e", "g", 4_000) is None  # it would fit, but a paused one waits before it
    assert policy.release("a") == [("e", 0)]  # cancelled while paused: gone from the resumes too
    assert not policy._resumes and policy.slots[0].paused == 0 and policy.slots[0].active == 4
    assert policy.slots[0].reserved == 5_000 + 3 * 1_000


class _Turns(_KVReporter):
    """An engine that generates `tokens` ids per call and counts the calls it served."""

    def __init__(self, name: str, total: int, tokens: int):
        super().__init__(name, total)
        self.tokens, self.calls = tokens, 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.calls += 1
        await asyncio.sleep(0)
        return Generation([1] * self.tokens, [0.0] * self.tokens, "stop")


async def test_the_scheduler_holds_a_paused_trajectory_at_its_next_turn_until_room_frees():
    engine = _Turns("a", 1_000, tokens=300)
    pool = RolloutScheduler([engine], reserve=0.2)  # floor 0.2 x 1000 = 200 tokens
    first, second = pool.lease("g", 1_000), pool.lease("g", 1_000)
    a, b = await first.__aenter__(), await second.__aenter__()
    await a.generate([0] * 100, SamplingParams(max_tokens=300))  # a holds 400, in a tool call now
    await b.generate([0] * 300, SamplingParams(max_tokens=300))  # b 600: 1000, within the budget
    b_next = asyncio.create_task(b.generate([0] * 650, SamplingParams(max_tokens=300)))
    await asyncio.sleep(0)  # b's prompt grew to 650: 1050 > 1000, so a (in its tool call) pauses
    assert pool.policy.pauses == 1
    a_next = asyncio.create_task(a.generate([0] * 420, SamplingParams(max_tokens=300)))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not a_next.done() and engine.calls == 3  # a waits at its next turn ...
    await b_next
    await second.__aexit__(None, None, None)  # ... until b is done
    assert len((await a_next).token_ids) == 300 and engine.calls == 4
    await first.__aexit__(None, None, None)
    assert pool.policy.slots[0].reserved == 0 and not pool._resuming


async def test_a_trajectory_cancelled_while_paused_gives_everything_back():
    engine = _Turns("a", 1_000, tokens=300)
    pool = RolloutScheduler([engine], reserve=0.2)
    tool = asyncio.Event()

    async def trajectory() -> None:
        async with pool.lease("g", 1_000) as leased:
            await leased.generate([0] * 100, SamplingParams(max_tokens=300))
            await tool.wait()  # its tool call: it holds 400 meanwhile
            await leased.generate([0] * 420, SamplingParams(max_tokens=300))

    paused = asyncio.create_task(trajectory())
    await asyncio.sleep(0.01)
    other = pool.lease("g", 1_000)
    leased = await other.__aenter__()
    await leased.generate([0] * 700, SamplingParams(max_tokens=300))  # 400 + 700 > 1000: it pauses
    tool.set()
    await asyncio.sleep(0.01)
    assert pool.policy.pauses == 1 and not paused.done() and pool._resuming  # 1000 + 400 > 1000
    paused.cancel()
    with pytest.raises(asyncio.CancelledError):
        await paused
    assert not pool._resuming and not pool.policy._resumes and pool.policy.slots[0].paused == 0
    await other.__aexit__(None, None, None)
    assert pool.policy.slots[0].reserved == 0 and pool.policy.slots[0].active == 0


class _Gated(_Turns):
    """_Turns whose calls with a prompt of a gated length wait for their gate: a turn held mid-flight."""

    def __init__(self, name: str, total: int, tokens: int):
        super().__init__(name, total, tokens)
        self.gates: dict[int, asyncio.Event] = {}

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if len(prompt_ids) in self.gates:
            await self.gates[len(prompt_ids)].wait()
        return await super().generate(prompt_ids, params)


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_a_tool_return_wakes_the_paused_trajectory_that_its_drain_resumes():
    """w waits to resume; r's growth pauses x, freeing room without a drain; x's tool return drains:
    w resumes there, and x's next turn (not w's) must hand w its engine."""
    engine = _Gated("a", 2_000, tokens=100)
    pool = RolloutScheduler([engine], reserve=0.1)  # floor 0.1 x 1000 = 100 tokens
    sp = SamplingParams(max_tokens=100)
    leases = [pool.lease("g", 1_000) for _ in range(3)]
    w, x, r = [await lease.__aenter__() for lease in leases]
    tw, tx, _ = list(pool.policy._placed)
    await w.generate([0] * 300, sp)  # w holds 400, in its tool call
    await x.generate([0] * 800, sp)  # x 900: 1300 with r's floor 100 + w's 400
    await r.generate([0] * 1_000, sp)  # 400 + 900 + 1000 > 2000: w pauses; r ends at 1100 (2000)
    assert pool.policy._placed[tw].paused and pool.policy.pauses == 1
    w_next = asyncio.create_task(w.generate([0] * 500, sp))
    await _settle()
    assert not w_next.done()  # 2000 + 400 > 2000: w waits to resume
    engine.gates[1_200] = gate = asyncio.Event()
    r_next = asyncio.create_task(r.generate([0] * 1_200, sp))
    await _settle()  # r's 1200 (900 + 1200 > 2000): x pauses; 1200 reserved now, r held mid-turn
    assert pool.policy._placed[tx].paused and pool.policy.slots[0].reserved == 1_200 and not w_next.done()
    x_next = asyncio.create_task(x.generate([0] * 950, sp))
    await _settle()  # x's return drains: w resumes (1200 + 400), x waits (1600 + 900 > 2000)
    assert w_next.done() and not x_next.done()
    z_lease = pool.lease("h", 1_000)
    z = asyncio.create_task(z_lease.__aenter__())
    await _settle()
    assert not z.done()  # queued behind x, which waits to resume
    gate.set()
    await r_next
    await leases[2].__aexit__(None, None, None)  # r done: x resumes, then z starts (1500 + 100)
    assert len((await x_next).token_ids) == 100 and z.done()
    for lease in [*leases[:2], z_lease]:
        await lease.__aexit__(None, None, None)
    assert pool.policy.slots[0].reserved == 0 and not pool._resuming and engine.calls == 6


async def test_a_paused_trajectory_resumes_its_next_turn_on_the_engine_with_room():
    a, b = _Turns("a", 1_000, tokens=100), _Turns("b", 1_000, tokens=100)
    pool = RolloutScheduler([a, b], reserve=0.1)  # floor 100 for L = 1000
    sp = SamplingParams(max_tokens=100)
    leases = [pool.lease("g", 1_000), pool.lease("g", 1_000), pool.lease("h", 1_000)]
    w, r, _ = [await lease.__aenter__() for lease in leases]  # w and r on a (their group's), h's on b
    await w.generate([0] * 300, sp)  # w holds 400, in its tool call
    await r.generate([0] * 700, sp)  # 400 + 700 > 1000: w pauses
    assert [s.active for s in pool.policy.slots] == [2, 1] and pool.policy.pauses == 1
    await w.generate([0] * 500, sp)  # a has no room (800 + 400): b re-prefills w's whole context
    assert (a.calls, b.calls) == (2, 1) and [s.active for s in pool.policy.slots] == [1, 2]
    engines = pool.metrics()["engines"]
    assert [e["leases"] for e in engines] == [2, 2] and engines[1]["peak_in_flight"] == 2
    for lease in leases:
        await lease.__aexit__(None, None, None)
    assert [s.reserved for s in pool.policy.slots] == [0, 0] and [
        e["in_flight"] for e in pool.metrics()["engines"]
    ] == [0, 0]
