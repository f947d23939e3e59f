"""Truncated importance sampling against the engine's sampling log-probs, pinned by hand computation:
the weight min(exp(old - engine), cap) per trained token, its place in the loss (a detached factor on
the per-token surrogate), its diagnostics, and the config checks that keep the ratio meaningful; then
the weights' edges (see docs/mutation.md)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from pydantic import ValidationError
from tests.tensors import log_t, t

from tirl.distributed.groups import DistInfo
from tirl.rl.config import AlgorithmConfig, OptimConfig, TrainConfig
from tirl.rl.importance import truncated_is_weights
from tirl.rl.losses import AGGREGATIONS, POLICY_LOSSES, BatchCounts, ClipConfig, Objective, PolicyInputs
from tirl.rl.policy import Policy, TrainSample
from tirl.rl.update import grpo_update


def test_weights_are_the_truncated_ratio_of_trained_tokens():
    # pi_old 0.6, 0.3, 0.2, 0.9 against the engine's 0.2, 0.3, 0.4, 0.01: ratios 3, 1, 0.5, 90
    old, engine = log_t([[0.6, 0.3, 0.2, 0.9]]), log_t([[0.2, 0.3, 0.4, 0.01]])
    mask = torch.tensor([[1, 1, 1, 0]])  # the last token is not trained (a tool response)
    w = truncated_is_weights(old, engine, mask, cap=2.0)
    assert w.ratio[0].tolist() == pytest.approx([3.0, 1.0, 0.5, 1.0])
    assert w.weight[0].tolist() == pytest.approx([2.0, 1.0, 0.5, 1.0])
    assert w.truncated.tolist() == [[True, False, False, False]]
    assert not w.weight.requires_grad
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(old, engine, mask, cap=0.0)


# sequence 0 (A=+1): ratios pi/pi_old 1.0, 1.5, 0.5; sequence 1 (A=-1): 0.5, 1.5, padding
RATIOS, ADV, MASK = [[1.0, 1.5, 0.5], [0.5, 1.5, 1.0]], [1.0, -1.0], [[1, 1, 1], [1, 1, 0]]
# pi_old / engine per token: 3 (truncated to 2), 1, 0.5 | 1, 0.25, (padding: engine knows nothing)
OLD, ENGINE = [[0.6, 0.3, 0.2], [0.4, 0.1, 0.5]], [[0.2, 0.3, 0.4], [0.4, 0.4, 1.0]]


def _inputs(requires_grad: bool) -> PolicyInputs:
    old = log_t(OLD)
    lp = (old + log_t(RATIOS)).detach().requires_grad_(requires_grad)
    return PolicyInputs(lp, old, torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK), log_t(ENGINE))


def test_tis_weights_each_tokens_surrogate_in_the_loss_and_its_gradient():
    inputs = _inputs(requires_grad=True)
    objective = Objective(POLICY_LOSSES["grpo"], AGGREGATIONS["token"], ClipConfig(0.2, 0.28), tis_cap=2.0)
    loss, diag = objective(inputs, BatchCounts(tokens=5, sequences=2))
    # surrogates min(rho*A, clip(rho, 0.8, 1.28)*A): 1.0, 1.28, 0.5 | -0.8, -1.5; weights 2, 1, 0.5 | 1, 0.25
    assert float(loss.detach()) == pytest.approx(-(2 * 1.0 + 1.28 + 0.5 * 0.5 - 0.8 - 0.25 * 1.5) / 5)
    loss.backward()
    # d/dlogp of -w*rho*A/5 where rho is not clipped (w is a constant): -w*rho*A/5; 0 where clipped
    grad = inputs.logprobs.grad.tolist()
    assert grad[0] == pytest.approx([-2 * 1.0 / 5, 0.0, -0.5 * 0.5 / 5])
    assert grad[1] == pytest.approx([0.0, 0.25 * 1.5 / 5, 0.0])
    sums = diag.per_token(5)
    assert sums["train/tis_weight_mean"] == pytest.approx((2 + 1 + 0.5 + 1 + 0.25) / 5)
    assert sums["train/tis_truncated_frac"] == pytest.approx(1 / 5)
    assert sums["train/tis_ratio_max"] == pytest.approx(3.0)


def test_without_a_cap_the_engine_logprobs_change_nothing():
    plain = Objective(POLICY_LOSSES["grpo"], AGGREGATIONS["token"], ClipConfig(0.2, 0.28))
    loss, diag = plain(_inputs(False), BatchCounts(5, 2))
    assert float(loss) == pytest.approx(-(1.0 + 1.28 + 0.5 - 0.8 - 1.5) / 5)
    assert not any(k.startswith("tis") for k in diag.sums)
    with pytest.raises(ValueError, match="no engine log-probs"):
        capped = Objective(tis_cap=2.0)
        capped(
            PolicyInputs(log_t(RATIOS), log_t(OLD), torch.tensor(ADV), torch.tensor(MASK)), BatchCounts(5, 2)
        )


def test_config_tis_cap_is_checked(tiny_model_dir):
    assert AlgorithmConfig().tis_cap is None  # off by default: the paper's recipe
    with pytest.raises(ValidationError):
        AlgorithmConfig(tis_cap=0.5)
    ok = TrainConfig(
        model=str(tiny_model_dir), stages=[{"steps": 1, "data": "x"}], algorithm={"tis_cap": 2.0}
    )
    assert ok.algorithm.tis_cap == 2.0
    with pytest.raises(ValidationError, match=r"agent\.temperature=1\.0"):
        TrainConfig(
            model="m",
            stages=[{"steps": 1, "data": "x"}],
            algorithm={"tis_cap": 2.0},
            agent={"temperature": 0.6},
        )


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return Policy(
        str(tiny_model_dir), OptimConfig(device="cpu", lr=1e-2), DistInfo(0, 1, torch.device("cpu")), 1
    )


def _samples(policy: Policy, engine_shift: float) -> list[TrainSample]:
    samples = [TrainSample([5, 9, 17, 4, 33, 8], [0, 1, 1, 0, 1], 1.0), TrainSample([7, 3, 21], [1, 1], -1.0)]
    policy.compute_logprobs(samples, "old_logprobs")
    for s in samples:  # the engine sampled with log-probs `engine_shift` above the trainer's
        s.engine_logprobs = (s.old_logprobs + engine_shift).tolist()
        s.old_logprobs = None
    return samples


def test_grpo_update_applies_tis_through_the_policy(policy):
    """Through Policy and grpo_update: an engine that agrees with the trainer gives weight 1 everywhere
    (the same update as without TIS); one that found every token twice as likely gives weight 1/2."""
    state = copy.deepcopy(policy.model.state_dict())
    m = grpo_update(policy, _samples(policy, 0.0), AlgorithmConfig(tis_cap=2.0))
    assert m["train/tis_weight_mean"] == pytest.approx(1.0, abs=1e-5) and m["train/tis_truncated_frac"] == 0
    after_tis = copy.deepcopy(policy.model.state_dict())
    policy.model.load_state_dict(state)
    policy.reset_optimizer()
    grpo_update(policy, _samples(policy, 0.0), AlgorithmConfig())
    for k, v in policy.model.state_dict().items():
        torch.testing.assert_close(v, after_tis[k], rtol=0, atol=1e-6)
    policy.model.load_state_dict(state)
    policy.reset_optimizer()
    m = grpo_update(
        policy, _samples(policy, torch.log(torch.tensor(2.0)).item()), AlgorithmConfig(tis_cap=2.0)
    )
    assert m["train/tis_weight_mean"] == pytest.approx(0.5, rel=1e-4)
    assert m["train/tis_ratio_max"] == pytest.approx(0.5, rel=1e-4)
    policy.model.load_state_dict(state)


# ---- the TIS weights' edges: the cap's check, truncation strictly above it, the log-ratio bound ----


def test_tis_cap_must_be_positive():
    x = t([[0.0]])
    with pytest.raises(ValueError) as err:
        truncated_is_weights(x, x, t([[1]]), cap=0.0)
    assert str(err.value) == "the TIS cap must be > 0, got 0.0"
    with pytest.raises(ValueError):
        truncated_is_weights(x, x, t([[1]]), cap=-1.0)
    assert truncated_is_weights(x, x, t([[1]]), cap=1e-9).weight.item() == pytest.approx(1e-9)


def test_tis_truncates_strictly_above_the_cap_and_only_trained_tokens():
    old = t([[0.0, 0.0, math.log(4.0), 0.0]])
    engine = t([[0.0, 0.0, 0.0, math.log(4.0)]])  # ratios 1, 1, 4, 1/4
    w = truncated_is_weights(old, engine, t([[1, 0, 1, 1]]), cap=1.0)
    assert w.truncated.tolist() == [[False, False, True, False]]  # ratio == cap is not truncated
    assert w.ratio[0].tolist() == pytest.approx([1.0, 1.0, 4.0, 0.25])
    assert w.weight[0].tolist() == pytest.approx([1.0, 1.0, 1.0, 0.25])
    # an untrained token is never reported truncated, even when the cap is below its ratio of 1
    w = truncated_is_weights(old, engine, t([[1, 0, 1, 1]]), cap=0.5)
    assert w.truncated.tolist() == [[True, False, True, False]]
    assert w.ratio[0, 1].item() == 1.0


def test_tis_log_ratio_is_bounded_at_20_both_ways():
    old, engine = t([[30.0, -30.0, 19.5]]), t([[0.0, 0.0, 0.0]])
    w = truncated_is_weights(old, engine, t([[1, 1, 1]]), cap=1e12)
    assert w.ratio[0].tolist() == pytest.approx([math.exp(20), math.exp(-20), math.exp(19.5)], rel=1e-12)
    assert not w.weight.requires_grad
