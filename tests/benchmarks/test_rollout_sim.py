"""The rollout simulator: the scheduler's own Admission placing trajectories on simulated engines."""

from __future__ import annotations

import math

import pytest

from rollout_sim import EngineModel, Workload, simulate

ENGINE = EngineModel(kv_tokens=40_000)


@pytest.fixture(scope="module")
def specs():
    shape = Workload(
        "heavy tail",
        turn_tokens=lambda r: r.lognormvariate(math.log(500), 1.2),
        tool_latency_s=lambda r: r.lognormvariate(math.log(0.3), 1.0),
        prompts=16,
        group_size=8,
        max_len=4096,
    )
    return shape.sample(seed=1)


def test_workload_is_multi_turn_heavy_tailed_and_within_l(specs):
    lengths = sorted(s.length for s in specs)
    assert len(specs) == 128 and max(lengths) <= 4096
    assert any(len(s.turn_tokens) >= 3 for s in specs) and any(len(s.turn_tokens) == 1 for s in specs)
    turns = sorted(t for s in specs for t in s.turn_tokens)
    assert turns[-1] > 5 * turns[len(turns) // 2]  # the tail is far from the median
    assert sum(1 for n in lengths if n >= 4096 - 64) > 0  # some trajectories run into L
    assert all(len(s.tool_tokens) == len(s.turn_tokens) - 1 == len(s.tool_latency_s) for s in specs)


def test_group_difficulty_makes_rollouts_of_one_prompt_alike():
    def spread_of_group_means(sigma: float) -> float:
        shape = Workload(
            "g",
            turn_tokens=lambda r: r.lognormvariate(math.log(300), 0.5),
            tool_latency_s=lambda r: 0.1,
            prompts=24,
            group_size=8,
            difficulty_sigma=sigma,
        )
        specs = shape.sample(seed=3)
        means = [sum(s.length for s in specs[i : i + 8]) / 8 for i in range(0, len(specs), 8)]
        return max(means) / min(means)

    assert spread_of_group_means(1.0) > 2 * spread_of_group_means(0.0)


def test_static_overflows_and_recomputes_dynamic_never_preempts(specs):
    static = simulate(specs, 2, ENGINE, "static", 4096)
    dynamic = simulate(specs, 2, ENGINE, "dynamic", 4096)
    expected = sum(sum(s.turn_tokens) for s in specs)
    assert static.generated_tokens == dynamic.generated_tokens == expected
    assert static.preemptions > 0 and static.recomputed_tokens > 0
    assert dynamic.preemptions == 0 and dynamic.recomputed_tokens == 0  # K = 40000 // 4096 per engine
    assert dynamic.mean_batch <= 2 * (40_000 // 4096)
    assert 0 < dynamic.utilization <= 1 and 0 < static.utilization <= 1


def test_turn_synchronous_static_waits_for_the_slowest_turn_and_tool(specs):
    asynchronous = simulate(specs, 2, ENGINE, "static", 4096)
    synchronous = simulate(specs, 2, ENGINE, "static", 4096, sync_turns=True)
    assert synchronous.generated_tokens == asynchronous.generated_tokens
    assert synchronous.makespan_s > asynchronous.makespan_s
    with pytest.raises(ValueError, match="static"):
        simulate(specs, 2, ENGINE, "dynamic", 4096, sync_turns=True)


def test_papers_free_kv_rule_fills_the_cache_and_preempts(specs):
    """K = free KV // L at each hand-out lets running trajectories outgrow the cache; full L never does."""
    free_kv = simulate(specs, 2, ENGINE, "dynamic", 4096, rule="free_kv")
    full_l = simulate(specs, 2, ENGINE, "dynamic", 4096)
    assert free_kv.preemptions > 0 and free_kv.mean_batch > full_l.mean_batch


def test_simulation_is_deterministic_and_rejects_impossible_loads(specs):
    a = simulate(specs, 2, ENGINE, "dynamic", 4096, reserve=0.5)
    b = simulate(specs, 2, ENGINE, "dynamic", 4096, reserve=0.5)
    assert a == b
    with pytest.raises(ValueError, match="KV cache"):
        simulate(specs, 2, EngineModel(kv_tokens=1_000), "dynamic", 4096)
