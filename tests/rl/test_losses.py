"""The objective registries pinned by hand-computed values: Dr.GRPO, GSPO, dual clip, aggregations,
diagnostics, KL/entropy terms, and config names derived from the registries."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from tirl.rl.advantages import ADVANTAGES
from tirl.rl.config import AlgorithmConfig
from tirl.rl.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    BatchCounts,
    ClipConfig,
    Diagnostics,
    Objective,
    PolicyInputs,
    TokenLoss,
    gspo_loss,
    kl_k3,
)


def _lp(rows):
    return torch.log(torch.tensor(rows, dtype=torch.float64))


def _inputs(ratios, adv, mask, requires_grad=False):
    lp = _lp(ratios).requires_grad_(requires_grad)
    return PolicyInputs(lp, torch.zeros_like(lp), torch.tensor(adv, dtype=torch.float64), torch.tensor(mask))


# sequence 0 (A=+1): ratios 1.0, 1.5, 0.5; sequence 1 (A=-1): ratios 0.5, 1.5, padding
RATIOS, ADV, MASK = [[1.0, 1.5, 0.5], [0.5, 1.5, 1.0]], [1.0, -1.0], [[1, 1, 1], [1, 1, 0]]
SURROGATE = [[1.0, 1.28, 0.5], [-0.8, -1.5]]  # min(rho*A, clip(rho, 0.8, 1.28)*A) per token


def test_advantage_registry_by_hand():
    # rewards 1,0,0,0: mean 0.25, unbiased std 0.5
    assert ADVANTAGES["grpo"]([1, 0, 0, 0]) == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert ADVANTAGES["dr_grpo"]([1, 0, 0, 0]) == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert ADVANTAGES["dr_grpo"]([1.0]) == [0.0] and ADVANTAGES["dr_grpo"]([1, 1]) == [0.0, 0.0]


@pytest.mark.parametrize(
    ("normalization", "expected"),
    [
        ("token", -(1.0 + 1.28 + 0.5 - 0.8 - 1.5) / 5),  # every trained token weighs the same
        ("sequence", -((1.0 + 1.28 + 0.5) / 3 + (-0.8 - 1.5) / 2) / 2),  # every trajectory weighs the same
        (
            "constant",
            -((1.0 + 1.28 + 0.5) + (-0.8 - 1.5)) / (10 * 2),
        ),  # Dr.GRPO: token sums / (L * B), L = 10
    ],
)
def test_grpo_loss_under_each_aggregation(normalization, expected):
    inputs = _inputs(RATIOS, ADV, MASK)
    objective = Objective(POLICY_LOSSES["grpo"], AGGREGATIONS[normalization], ClipConfig(0.2, 0.28))
    loss, _ = objective(inputs, BatchCounts(tokens=5, sequences=2, loss_constant=10))
    assert float(loss) == pytest.approx(expected)


def test_gspo_clips_the_sequence_ratio_and_has_gspo_gradient():
    inputs = _inputs(RATIOS, ADV, MASK, requires_grad=True)
    s0 = 0.75 ** (1 / 3)  # exp(mean(log 1, log 1.5, log 0.5)) = (1 * 1.5 * 0.5) ** (1/3)
    s1 = 0.75**0.5  # (0.5 * 1.5) ** (1/2)
    tl = gspo_loss(inputs, ClipConfig(0.2, 0.28))
    assert tl.ratio[0, :3].tolist() == pytest.approx([s0] * 3) and tl.ratio[1, :2].tolist() == pytest.approx(
        [s1] * 2
    )
    objective = Objective(gspo_loss, AGGREGATIONS["sequence"], ClipConfig(0.2, 0.28))
    loss, diag = objective(inputs, BatchCounts(5, 2))
    assert float(loss.detach()) == pytest.approx(-(s0 - s1) / 2)  # neither ratio leaves [0.8, 1.28]
    loss.backward()
    # d/dlogp_t of -(1/B)(1/|y_i|) sum_t s_i A_i = -A_i s_i / (B |y_i|): every token of a sequence alike
    assert inputs.logprobs.grad[0].tolist() == pytest.approx([-s0 / 6] * 3)
    assert inputs.logprobs.grad[1, :2].tolist() == pytest.approx([s1 / 4] * 2)
    assert diag.sums["clip_frac_low"] == 0 and diag.sums["clip_frac_high"] == 0

    # GSPO's own clip range (3e-4 / 4e-4): sequence 1 (A<0, s1 = 0.866) is clipped, all its tokens
    inputs = _inputs(RATIOS, ADV, MASK, requires_grad=True)
    objective = Objective(gspo_loss, AGGREGATIONS["sequence"], ClipConfig(3e-4, 4e-4))
    loss, diag = objective(inputs, BatchCounts(5, 2))
    assert float(loss.detach()) == pytest.approx(-(s0 - (1 - 3e-4)) / 2)
    loss.backward()
    assert inputs.logprobs.grad[1].tolist() == [0.0, 0.0, 0.0]
    assert diag.sums["clip_frac_low"] == 2


def test_dual_clip_bounds_negative_advantage_tokens():
    # A = -1, ratios 5 and 2, dual clip c = 3: surrogates max(min(-5, -1.28), -3) = -3, max(-2, -3) = -2
    inputs = _inputs([[5.0, 2.0]], [-1.0], [[1, 1]], requires_grad=True)
    objective = Objective(POLICY_LOSSES["grpo"], AGGREGATIONS["token"], ClipConfig(0.2, 0.28, dual_clip=3.0))
    loss, diag = objective(inputs, BatchCounts.of(inputs.mask))
    assert float(loss.detach()) == pytest.approx((3 + 2) / 2)
    loss.backward()
    assert inputs.logprobs.grad[0].tolist() == pytest.approx([0.0, 2.0 / 2])  # the bounded token: no gradient
    assert diag.sums["dual_clip_frac"] == 1
    without = Objective(POLICY_LOSSES["grpo"], AGGREGATIONS["token"], ClipConfig(0.2, 0.28))
    assert float(without(_inputs([[5.0, 2.0]], [-1.0], [[1, 1]]), BatchCounts(2, 1))[0]) == pytest.approx(3.5)


def test_diagnostics_by_hand():
    inputs = _inputs(RATIOS, ADV, MASK)
    _, diag = Objective()(inputs, BatchCounts(5, 2))
    m = diag.per_token(5)
    kl = [(r - 1) - math.log(r) for r in (1.0, 1.5, 0.5, 0.5, 1.5)]  # CleanRL's approx_kl per token
    assert m["train/approx_kl"] == pytest.approx(sum(kl) / 5)
    assert m["train/ratio_mean"] == pytest.approx((1.0 + 1.5 + 0.5 + 0.5 + 1.5) / 5)
    assert m["train/ratio_max"] == pytest.approx(1.5)  # the padding's ratio 1.0 is not a trained token
    assert (m["train/clip_frac_low"], m["train/clip_frac_high"], m["train/clip_frac"]) == (0.2, 0.2, 0.4)
    assert m["train/dual_clip_frac"] == 0
    # micro-batches add up: two halves give the same sums and max as the whole
    total = Diagnostics()
    for rows in ((0,), (1,)):
        part = PolicyInputs(
            inputs.logprobs[list(rows)],
            inputs.old_logprobs[list(rows)],
            torch.tensor([ADV[r] for r in rows]),
            inputs.mask[list(rows)],
        )
        total.add(Objective()(part, BatchCounts(5, 2))[1])
    assert total.per_token(5) == pytest.approx(m)


def test_kl_and_entropy_terms():
    inputs = _inputs([[1.0, 1.0]], [0.0], [[1, 0]])  # A = 0: only the extra terms remain
    ref = torch.log(torch.tensor([[0.5, 1.0]], dtype=torch.float64))  # ref/pi = 0.5 on the trained token
    entropy = torch.tensor([[2.0, 7.0]], dtype=torch.float64)
    k3 = 0.5 - math.log(0.5) - 1.0
    assert float(kl_k3(inputs.logprobs, ref)[0, 0]) == pytest.approx(k3)
    objective = Objective(kl_coef=0.1, entropy_coef=0.01)
    loss, diag = objective(inputs, BatchCounts(1, 1), entropy=entropy, ref_logprobs=ref)
    assert float(loss) == pytest.approx(0.1 * k3 - 0.01 * 2.0)
    assert diag.sums["kl"] == pytest.approx(k3) and diag.sums["entropy"] == 2.0
    with pytest.raises(ValueError, match="reference"):
        objective(inputs, BatchCounts(1, 1))


def half_loss(inputs: PolicyInputs, clip: ClipConfig) -> TokenLoss:
    """A user's policy loss (loaded by path in the test below): half the GRPO loss."""
    tl = POLICY_LOSSES["grpo"](inputs, clip)
    tl.loss = tl.loss / 2
    return tl


def test_config_names_come_from_the_registries():
    alg = AlgorithmConfig(
        advantage="dr_grpo", policy_loss="gspo", loss_normalization="constant", dual_clip=3.0
    )
    objective = Objective.from_config(alg)
    assert objective.policy_loss is gspo_loss and objective.aggregate is AGGREGATIONS["constant"]
    assert objective.clip == ClipConfig(0.2, 0.28, 3.0)
    with pytest.raises(ValidationError, match="unknown policy loss 'ppo': use one of grpo, gspo"):
        AlgorithmConfig(policy_loss="ppo")
    with pytest.raises(ValidationError, match="unknown advantage estimator 'rloo': use one of grpo, dr_grpo"):
        AlgorithmConfig(advantage="rloo")
    with pytest.raises(
        ValidationError, match="unknown loss normalization 'seq': use one of token, sequence, constant"
    ):
        AlgorithmConfig(loss_normalization="seq")
    with pytest.raises(ValidationError, match="cannot import module 'mypkg'"):
        AlgorithmConfig(policy_loss="mypkg:loss")
    user = Objective.from_config(AlgorithmConfig(policy_loss="tests.rl.test_losses:half_loss"))
    inputs = _inputs(RATIOS, ADV, MASK)
    assert float(user(inputs, BatchCounts(5, 2))[0]) == pytest.approx(-(1.0 + 1.28 + 0.5 - 0.8 - 1.5) / 10)
