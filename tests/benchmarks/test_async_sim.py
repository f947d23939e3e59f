"""The async training simulator: the producer's rules (admission, staleness bound, re-queue) driving the
rollout simulator, and the trainer's time, checked on a small cluster (a few seconds)."""

from __future__ import annotations

import pytest

from async_sim import Scenario, TrainerModel, paper_workload, simulate_training
from rollout_sim import EngineModel

WORKLOAD = paper_workload(prompts=16, group=8, max_len=4096)
ENGINE = EngineModel(kv_tokens=100_000)
STEPS = 4


@pytest.fixture(scope="module")
def outcomes():
    scenarios = [
        Scenario("colocated", 8, 8, 0),
        Scenario("disaggregated", 6, 2, 0),
        Scenario("async k=1", 6, 2, 1),
        Scenario("async k=2", 6, 2, 2),
    ]
    return {
        s.name: simulate_training(s, WORKLOAD, ENGINE, TrainerModel(), STEPS, warmup=1, gpus=8, seed=2)
        for s in scenarios
    }


def test_every_step_trains_p_groups_within_the_staleness_bound(outcomes):
    for name, out in outcomes.items():
        assert out.trained_groups == STEPS * WORKLOAD.prompts, name  # re-queued prompts are not lost
        assert max(out.staleness) <= out.scenario.staleness, name
        assert 0.0 <= out.gpu_idle <= 1.0 and 0.0 <= out.engine_idle <= 1.0, name
    for name in ("colocated", "disaggregated"):  # synchronous: on-policy, nothing in flight at a sync
        out = outcomes[name]
        assert set(out.staleness) == {0} and out.dropped == 0 and out.recomputed_tokens == 0
    assert outcomes["async k=1"].recomputed_tokens > 0  # syncs landed on requests in flight
    assert outcomes["async k=1"].dropped > 0  # slow groups went stale, yet every step trained P groups


def test_overlap_beats_the_synchronous_steps_on_the_same_gpus(outcomes):
    sync, k1 = outcomes["disaggregated"], outcomes["async k=1"]
    assert k1.trained_tokens_per_s > 1.2 * sync.trained_tokens_per_s
    assert k1.trainer_idle < sync.trainer_idle
    # colocated uses every GPU for both phases: faster than the same split run one phase at a time
    assert outcomes["colocated"].trained_tokens_per_s > sync.trained_tokens_per_s


def test_warmup_must_leave_steps_to_measure():
    with pytest.raises(ValueError, match="warmup"):
        simulate_training(Scenario("x", 2, 2, 0), WORKLOAD, ENGINE, TrainerModel(), 2, warmup=2, gpus=2)
