"""GRPO math pinned by hand-computed values: advantages, clipping on both sides, normalizations."""

from __future__ import annotations

import math

import pytest
import torch
from tests.tensors import log_t

from tirl.rl.grpo import clip_counts, entropy_from_logits, group_advantages, kl_k3, masked_sum, policy_loss


def test_group_advantages_by_hand():
    # rewards 1,0,0,0: mean 0.25, unbiased std sqrt(0.25) = 0.5
    adv = group_advantages([1, 0, 0, 0], eps=0.0)
    assert adv == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert group_advantages([1, 0, 0, 0]) == pytest.approx(adv, rel=1e-5)  # the default eps is tiny
    assert group_advantages([1, 0, 0, 0], normalize_std=False) == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert group_advantages([1, 1, 1]) == [0.0, 0.0, 0.0]  # no relative signal
    assert group_advantages([0.0]) == [0.0]
    assert group_advantages([]) == []


def test_token_level_loss_by_hand_and_clipping_both_sides():
    old = torch.zeros(2, 3, dtype=torch.float64)
    # sequence 0 (A=+1): ratios 1.0, 1.5 (clipped to 1.28), 0.5 (min keeps 0.5)
    # sequence 1 (A=-1): ratios 0.5 (clipped to 0.8 -> -0.8 < -0.5), 1.5 (min keeps -1.5), padding
    lp = torch.stack([log_t([1.0, 1.5, 0.5]), log_t([0.5, 1.5, 1.0])])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    surrogate = [1.0, 1.28, 0.5, -0.8, -1.5]
    loss = policy_loss(lp, old, adv, mask, 0.2, 0.28)
    assert float(loss) == pytest.approx(-sum(surrogate) / 5)
    seq = policy_loss(lp, old, adv, mask, 0.2, 0.28, normalization="sequence")
    assert float(seq) == pytest.approx(-((1.0 + 1.28 + 0.5) / 3 + (-0.8 - 1.5) / 2) / 2)
    assert clip_counts(lp, old, adv, mask, 0.2, 0.28) == (1, 1)  # 0.5 with A<0, 1.5 with A>0


def test_clip_higher_is_asymmetric():
    old = torch.zeros(1, 1, dtype=torch.float64)
    up = log_t([[1.25]])
    assert float(policy_loss(up, old, torch.tensor([1.0]), torch.ones(1, 1))) == pytest.approx(
        -1.25
    )  # < 1.28
    assert float(policy_loss(up, old, torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.2)) == pytest.approx(-1.2)


def test_clipped_tokens_get_no_gradient():
    old = torch.zeros(1, 2, dtype=torch.float64)
    lp = log_t([[2.0, 1.0]]).requires_grad_(True)
    policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2)).backward()
    assert lp.grad[0, 0] == 0.0  # ratio 2 > 1.28 with A>0: clipped
    assert lp.grad[0, 1] == pytest.approx(-0.5)  # d(-ratio*A/2)/dlp at ratio 1


def test_token_vs_sequence_normalization_weighting():
    """Token-level: every token weighs the same, so a long sequence counts more than a short one."""
    old = torch.zeros(2, 4, dtype=torch.float64)
    lp = torch.zeros(2, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    assert float(policy_loss(lp, old, adv, mask)) == pytest.approx(-(4 - 1) / 5)
    assert float(policy_loss(lp, old, adv, mask, normalization="sequence")) == pytest.approx(0.0)


def test_micro_batches_with_global_denominator_add_up():
    torch.manual_seed(0)
    lp, old = torch.randn(4, 6, dtype=torch.float64) * 0.3, torch.randn(4, 6, dtype=torch.float64) * 0.3
    mask = (torch.rand(4, 6) > 0.3).long()
    adv = torch.randn(4, dtype=torch.float64)
    whole = policy_loss(lp, old, adv, mask)
    denom = float(mask.sum())
    parts = sum(
        policy_loss(lp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], denominator=denom)
        for i in (0, 2)
    )
    assert float(parts) == pytest.approx(float(whole))
    # sequence normalization: the whole batch's number of trajectories is the denominator
    whole = policy_loss(lp, old, adv, mask, normalization="sequence")
    parts = sum(
        policy_loss(
            lp[i : i + 2],
            old[i : i + 2],
            adv[i : i + 2],
            mask[i : i + 2],
            normalization="sequence",
            denominator=4,
        )
        for i in (0, 2)
    )
    assert float(parts) == pytest.approx(float(whole))


def test_empty_mask_gives_zero_loss():
    z = torch.zeros(2, 3)
    assert float(policy_loss(z, z, torch.ones(2), torch.zeros(2, 3))) == 0.0
    assert float(policy_loss(z, z, torch.ones(2), torch.zeros(2, 3), normalization="sequence")) == 0.0


def test_kl_and_entropy():
    assert float(kl_k3(torch.tensor(0.3), torch.tensor(0.3))) == 0.0
    # log r = ref - logp = -1: k3 = r - log r - 1 = e^-1
    assert float(kl_k3(torch.tensor(-1.0), torch.tensor(-2.0))) == pytest.approx(math.exp(-1.0))
    uniform = torch.zeros(1, 1, 8)
    assert float(entropy_from_logits(uniform)) == pytest.approx(math.log(8))


def _of_ratios(*ratios: float) -> torch.Tensor:
    """Log-probs whose ratio to old log-probs of 0 are `ratios` (one sequence)."""
    return torch.tensor([[math.log(r) for r in ratios]])


def test_defaults_are_the_papers_clip_higher_and_ratios_are_new_over_old():
    z, ones = torch.zeros(1, 3), torch.ones(1, 3)
    # A = -1 at ratio 0.5: clipped at 1 - 0.2; A = +2 at ratio 1.5: clipped at 1 + 0.28; 1.1 unclipped
    assert float(policy_loss(_of_ratios(0.5, 0.5, 0.5), z, -torch.ones(1), ones)) == pytest.approx(0.8)
    assert float(policy_loss(_of_ratios(1.5, 1.5, 1.1), z, 2 * torch.ones(1), ones)) == pytest.approx(
        -2 * (1.28 + 1.28 + 1.1) / 3
    )
    # the ratio is exp(new - old), not exp(new + old)
    assert float(policy_loss(torch.full((1, 3), -1.0), torch.full((1, 3), -1.1), torch.ones(1), ones)) == (
        pytest.approx(-math.exp(0.1))
    )
    assert clip_counts(_of_ratios(0.5, 1.1, 1.5), z, -torch.ones(1), ones) == (1, 0)  # only 0.5 < 0.8
    assert clip_counts(_of_ratios(0.5, 1.1, 1.5), z, torch.ones(1), ones) == (0, 1)  # only 1.5 > 1.28
    # a token whose advantage is 0 (or positive) is never clipped low, one whose advantage is 0 never high
    assert clip_counts(_of_ratios(0.5, 0.5, 1.5), z, torch.tensor([[0.0, 0.5, 0.0]]), ones) == (0, 0)
    # both bounds are the caller's: low 1 - 0.6 = 0.4 clips nothing, high 1 + 0.05 clips 1.1 and 1.5
    assert clip_counts(_of_ratios(0.5, 1.1, 1.5), z, -torch.ones(1), ones, 0.6, 0.05) == (0, 0)
    assert clip_counts(_of_ratios(0.5, 1.1, 1.5), z, torch.ones(1), ones, 0.6, 0.05) == (0, 2)


def test_per_token_advantages_and_extreme_ratios():
    ones = torch.ones(1, 2)
    adv = torch.tensor([[1.0, -1.0]])  # one advantage per token, not per sequence
    assert float(policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), adv, ones)) == pytest.approx(0.0)
    # log-ratios are clamped to [-20, 20] before exp (no inf/NaN from a far-off token)
    assert float(
        policy_loss(torch.tensor([[-50.0]]), torch.zeros(1, 1), -torch.ones(1), torch.ones(1, 1))
    ) == (pytest.approx(0.8))
    assert clip_counts(
        torch.tensor([[-50.0, 50.0]]), torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), ones
    ) == (1, 1)
    assert float(kl_k3(torch.tensor(0.0), torch.tensor(-50.0))) == pytest.approx(math.exp(-20) + 20 - 1)
    assert float(kl_k3(torch.tensor(0.0), torch.tensor(50.0))) == pytest.approx(math.exp(20) - 20 - 1)


def test_masked_sum_defaults_sequence_denominator_and_errors():
    values = torch.tensor([[1.0, 3.0], [5.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert float(masked_sum(values, mask)) == pytest.approx(3.0)  # token mean: (1 + 3 + 5) / 3
    assert float(masked_sum(values, mask, "sequence")) == pytest.approx((2.0 + 5.0) / 2)
    assert float(masked_sum(values, mask, "sequence", denominator=7)) == pytest.approx(1.0)
    assert float(masked_sum(values, mask, denominator=9)) == pytest.approx(1.0)  # token sum 9 / 9
    assert float(masked_sum(values[:1], mask[:1], "sequence")) == pytest.approx(2.0)  # one sequence
    with pytest.raises(ValueError, match="unknown loss normalization 'seq'"):
        masked_sum(values, mask, "seq")


def test_advantage_eps_and_entropy_per_row():
    assert group_advantages([1.0, 0.0], eps=0.5) == pytest.approx(
        [0.5 / (2**-0.5 + 0.5), -0.5 / (2**-0.5 + 0.5)]
    )
    ent = entropy_from_logits(torch.tensor([[0.0, 0.0], [0.0, -100.0]]))
    assert ent.tolist() == pytest.approx([math.log(2), 0.0], abs=1e-6)


def test_log_ratios_are_clamped_to_plus_minus_20():
    one = torch.ones(1, 1)
    # exp(100) overflows float32: the clamp keeps the loss finite (exp(20)); exp(-50) becomes exp(-20)
    assert float(policy_loss(torch.tensor([[100.0]]), torch.zeros(1, 1), -torch.ones(1), one)) == (
        pytest.approx(math.exp(20), rel=1e-5)
    )
    assert float(policy_loss(torch.tensor([[-50.0]]), torch.zeros(1, 1), torch.ones(1), one)) == (
        pytest.approx(-math.exp(-20), rel=1e-5)
    )
