"""The objective registries pinned by hand-computed values: Dr.GRPO, GSPO, dual clip, aggregations,
diagnostics, KL/entropy terms, and config names derived from the registries; then the objective's
edges: exact clip and flag boundaries, numeric guards, defaults, resolvers' errors (docs/mutation.md)."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from pydantic import ValidationError
from tests.tensors import F64, log_t, t

from tirl.plugins import PluginError
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
    clipped_surrogate,
    constant_norm,
    entropy_from_logits,
    grpo_loss,
    gspo_loss,
    kl_k3,
    resolve_aggregation,
    resolve_policy_loss,
    sequence_mean,
    token_mean,
)


def _inputs(ratios, adv, mask, requires_grad=False):
    lp = log_t(ratios).requires_grad_(requires_grad)
    return PolicyInputs(lp, torch.zeros_like(lp), torch.tensor(adv, dtype=torch.float64), torch.tensor(mask))


# sequence 0 (A=+1): ratios 1.0, 1.5, 0.5; sequence 1 (A=-1): ratios 0.5, 1.5, padding
RATIOS, ADV, MASK = [[1.0, 1.5, 0.5], [0.5, 1.5, 1.0]], [1.0, -1.0], [[1, 1, 1], [1, 1, 0]]
SURROGATE = [[1.0, 1.28, 0.5], [-0.8, -1.5]]  # min(rho*A, clip(rho, 0.8, 1.28)*A) per token


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


# ---- the objective's edges that the hand-computed and property tests leave open: exact boundaries of
# each clip and flag, the numeric guards (log-ratio bounds, empty rows, zero counts), default settings,
# every diagnostic's value, and the registries' errors ----

# ---- losses: inputs, clip, ratios ----


def test_policy_inputs_broadcast_advantages_and_cast_the_mask():
    lp = t([[0.0, 0.0], [0.0, 0.0]])
    inputs = PolicyInputs(
        lp, lp, torch.tensor([1.0, -2.0], dtype=torch.float32), torch.tensor([[1, 0], [1, 1]])
    )
    assert inputs.mask.dtype == F64 and inputs.advantages.dtype == F64
    assert inputs.advantages.tolist() == [[1.0, 1.0], [-2.0, -2.0]]
    per_token = PolicyInputs(lp, lp, t([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1, 0], [1, 1]]))
    assert per_token.advantages.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert per_token.engine_logprobs is None


def test_clip_defaults_are_the_papers():
    assert ClipConfig() == ClipConfig(0.2, 0.28, None)
    objective = Objective()
    assert objective.policy_loss is grpo_loss and objective.aggregate is token_mean
    assert objective.clip == ClipConfig() and objective.tis_cap is None
    assert (objective.kl_coef, objective.entropy_coef) == (0.0, 0.0)
    assert not objective.needs_reference and Objective(kl_coef=0.1).needs_reference


def test_clip_flags_are_strict_at_both_bounds_and_need_the_right_sign():
    clip = ClipConfig(0.25, 0.5)  # bounds 0.75 and 1.5, exact in binary
    ratio = t([[0.75, 1.5, 0.5, 2.0, 0.5, 2.0, 0.5, 2.0]])
    adv = t([[-1.0, 1.0, -1.0, 1.0, 1.0, -1.0, 0.0, 0.0]])
    tl = clipped_surrogate(ratio, adv, clip)
    assert tl.clipped_low.tolist() == [[False, False, True, False, False, False, False, False]]
    assert tl.clipped_high.tolist() == [[False, False, False, True, False, False, False, False]]
    # -min(rho*A, clip(rho)*A)
    assert tl.loss[0].tolist() == pytest.approx([0.75, -1.5, 0.75, -1.5, -0.5, 2.0, 0.0, 0.0])
    assert not tl.dual_clipped.any() and not tl.ratio.requires_grad


def test_dual_clip_flags_only_a_surrogate_strictly_below_its_bound():
    # A = -1, c = 3: ratio 3 gives surrogate -3 == the bound (not flagged), ratio 4 gives -4 < -3
    ratio, adv = t([[3.0, 4.0, 4.0, 0.5]]), t([[-1.0, -1.0, 1.0, -2.0]])
    tl = clipped_surrogate(ratio, adv, ClipConfig(0.2, 0.28, dual_clip=3.0))
    assert tl.dual_clipped.tolist() == [[False, True, False, False]]
    assert tl.loss[0].tolist() == pytest.approx([3.0, 3.0, -1.28, 1.6])


def test_grpo_ratio_is_bounded_at_exp_20():
    lp = t([[30.0, -30.0, 0.5]])
    inputs = PolicyInputs(lp, torch.zeros_like(lp), t([1.0]), t([[1, 1, 1]]))
    assert grpo_loss(inputs, ClipConfig()).ratio[0].tolist() == pytest.approx(
        [math.exp(20), math.exp(-20), math.exp(0.5)], rel=1e-12
    )


def test_gspo_ratio_is_the_mean_over_trained_tokens_of_each_row():
    lp = t([[math.log(2.0), 5.0, 5.0], [7.0, 7.0, 7.0], [math.log(3.0), math.log(3.0), 0.0]])
    mask = t([[1, 0, 0], [0, 0, 0], [1, 1, 0]])
    inputs = PolicyInputs(lp.clone().requires_grad_(), torch.zeros_like(lp), t([1.0, 1.0, -1.0]), mask)
    tl = gspo_loss(inputs, ClipConfig(10.0, 10.0))
    # one trained token: its own ratio; no trained token: ratio 1 (not 0/0); two: their geometric mean
    assert tl.ratio.flatten().tolist() == pytest.approx([2.0] * 3 + [1.0] * 3 + [3.0] * 3)


def test_gspo_sequence_ratio_is_bounded_at_exp_20():
    lp = t([[40.0, 40.0], [-40.0, -40.0]])
    inputs = PolicyInputs(lp, torch.zeros_like(lp), t([1.0, 1.0]), t([[1, 1], [1, 1]]))
    assert gspo_loss(inputs, ClipConfig()).ratio.flatten().tolist() == pytest.approx(
        [math.exp(20)] * 2 + [math.exp(-20)] * 2, rel=1e-12
    )


# ---- aggregations and counts ----


def test_batch_counts_of_a_batch_never_divide_by_zero():
    assert BatchCounts.of(torch.zeros(3, 4)) == BatchCounts(1.0, 3.0, 1.0)
    assert BatchCounts.of(torch.ones(2, 5), loss_constant=9.0) == BatchCounts(10.0, 2.0, 9.0)
    assert BatchCounts.of(torch.ones(0, 5)) == BatchCounts(1.0, 1.0, 1.0)
    assert BatchCounts(4.0, 2.0).loss_constant == 1.0


def test_each_aggregation_by_hand_with_an_empty_row():
    values = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = t([[1, 1, 0], [0, 0, 0], [0, 0, 1]])
    counts = BatchCounts(tokens=6.0, sequences=4.0, loss_constant=5.0)
    assert float(token_mean(values, mask, counts)) == pytest.approx((1 + 2 + 9) / 6)
    assert float(sequence_mean(values, mask, counts)) == pytest.approx((1.5 + 0 + 9) / 4)
    assert float(constant_norm(values, mask, counts)) == pytest.approx((1 + 2 + 9) / (5 * 4))
    assert {"token": token_mean, "sequence": sequence_mean, "constant": constant_norm} == AGGREGATIONS


def test_kl_k3_by_hand_and_bounded():
    lp, ref = t([[0.0, 0.0, 0.0, 0.0]]), t([[math.log(0.5), 0.0, 30.0, -30.0]])
    kl = kl_k3(lp, ref)[0].tolist()
    assert kl[0] == pytest.approx(0.5 - math.log(0.5) - 1.0)
    assert kl[1] == 0.0
    assert kl[2] == pytest.approx(math.exp(20) - 20 - 1, rel=1e-12)
    assert kl[3] == pytest.approx(math.exp(-20) + 20 - 1, rel=1e-12)


def test_entropy_is_computed_in_float32_or_better():
    logits = torch.zeros(1, 2, 8, dtype=torch.bfloat16)
    h = entropy_from_logits(logits)
    assert h.dtype == torch.float32 and h.shape == (1, 2)
    assert h.flatten().tolist() == pytest.approx([math.log(8)] * 2, rel=1e-6)
    assert entropy_from_logits(t([[[0.0, -1e9]]])).item() == pytest.approx(0.0, abs=1e-9)


# ---- diagnostics ----


def test_diagnostics_add_sums_and_keep_the_largest_max_even_if_negative():
    d = Diagnostics(sums={"a": 1.0}, maxes={"m": -5.0})
    d.add(Diagnostics(sums={"a": 2.0, "b": 3.0}, maxes={"m": -3.0, "n": -7.0}))
    d.add(Diagnostics(sums={"b": 1.0}, maxes={"m": -4.0}))
    assert d.sums == {"a": 3.0, "b": 4.0} and d.maxes == {"m": -3.0, "n": -7.0}


def test_per_token_divides_sums_by_at_least_one_and_adds_the_clip_fractions_only_when_both_exist():
    d = Diagnostics(sums={"clip_frac_low": 1.0, "clip_frac_high": 3.0}, maxes={"ratio_max": 2.5})
    assert d.per_token(4.0) == {
        "train/clip_frac_low": 0.25,
        "train/clip_frac_high": 0.75,
        "train/ratio_max": 2.5,
        "train/clip_frac": 1.0,
    }
    assert Diagnostics(sums={"x": 3.0}).per_token(0.0) == {"train/x": 3.0}
    assert Diagnostics(sums={"x": 3.0}).per_token(0.5) == {"train/x": 3.0}
    assert "train/clip_frac" not in Diagnostics(sums={"clip_frac_low": 1.0}).per_token(1.0)
    assert "train/clip_frac" not in Diagnostics(sums={"clip_frac_high": 1.0}).per_token(1.0)


def test_objective_diagnostics_by_hand_with_tis():
    # ratios 2, 0.5 (trained), 8 (untrained); old - engine: log 4, 0, log 100 (untrained)
    old = t([[0.0, 0.0, 0.0]])
    lp = old + t([[math.log(2.0), math.log(0.5), math.log(8.0)]])
    engine = old - t([[math.log(4.0), 0.0, math.log(100.0)]])
    inputs = PolicyInputs(lp, old, t([1.0]), t([[1, 1, 0]]), engine)
    loss, diag = Objective(tis_cap=3.0)(inputs, BatchCounts(2.0, 1.0))
    # surrogates min(rho A, clip(rho) A) = 1.28, 0.5; weights 3 (truncated from 4), 1
    assert float(loss) == pytest.approx(-(3 * 1.28 + 1 * 0.5) / 2)
    assert diag.sums == pytest.approx(
        {
            "clip_frac_low": 0.0,
            "clip_frac_high": 1.0,
            "dual_clip_frac": 0.0,
            "ratio_mean": 2.5,
            "approx_kl": (1 - math.log(2)) + (-0.5 + math.log(2)),
            "tis_weight_mean": 4.0,
            "tis_truncated_frac": 1.0,
        }
    )
    assert diag.maxes == pytest.approx({"ratio_max": 2.0, "tis_ratio_max": 4.0})


def test_objective_with_nothing_trained_reports_max_ratios_of_one():
    lp = t([[0.7, 0.9]])
    inputs = PolicyInputs(lp, torch.zeros_like(lp), t([1.0]), t([[0, 0]]), torch.zeros_like(lp))
    loss, diag = Objective(tis_cap=2.0)(inputs, BatchCounts(1.0, 1.0))
    assert float(loss) == 0.0
    assert diag.maxes == {"ratio_max": 1.0, "tis_ratio_max": 1.0}
    assert diag.sums["ratio_mean"] == 0.0 and diag.sums["tis_weight_mean"] == 0.0


def test_tis_without_engine_logprobs_is_an_error_that_says_so():
    lp = t([[0.0]])
    with pytest.raises(ValueError) as err:
        Objective(tis_cap=2.0)(PolicyInputs(lp, lp, t([1.0]), t([[1]])), BatchCounts(1.0, 1.0))
    assert str(err.value) == "tis_cap is set but the batch has no engine log-probs"


def test_kl_term_is_aggregated_like_the_loss_and_needs_the_reference():
    lp = t([[0.0, 0.0], [0.0, 0.0]])
    ref = t([[math.log(0.5), 0.0], [math.log(2.0), math.log(0.5)]])
    mask = t([[1, 0], [1, 1]])
    k3 = [0.5 - math.log(0.5) - 1, 2 - math.log(2) - 1]
    inputs = PolicyInputs(lp, lp, t([0.0, 0.0]), mask)
    objective = Objective(aggregate=sequence_mean, kl_coef=0.5)
    loss, diag = objective(inputs, BatchCounts(3.0, 2.0), ref_logprobs=ref)
    assert float(loss) == pytest.approx(0.5 * (k3[0] + (k3[1] + k3[0]) / 2) / 2)
    assert diag.sums["kl"] == pytest.approx(2 * k3[0] + k3[1])
    with pytest.raises(ValueError) as err:
        objective(inputs, BatchCounts(3.0, 2.0))
    assert str(err.value) == "kl_coef > 0 needs the reference policy's log-probs"
    _, no_kl = Objective()(inputs, BatchCounts(3.0, 2.0), ref_logprobs=ref)
    assert "kl" not in no_kl.sums


def test_entropy_is_reported_always_and_a_bonus_only_with_a_coefficient():
    lp = t([[0.0, 0.0]])
    inputs = PolicyInputs(lp, lp, t([0.0]), t([[1, 0]]))
    entropy = t([[2.0, 5.0]])
    loss, diag = Objective()(inputs, BatchCounts(1.0, 1.0), entropy=entropy)
    assert float(loss) == 0.0 and diag.sums["entropy"] == 2.0
    loss, _ = Objective(entropy_coef=0.25)(inputs, BatchCounts(1.0, 1.0), entropy=entropy)
    assert float(loss) == pytest.approx(-0.5)
    _, diag = Objective(entropy_coef=0.25)(inputs, BatchCounts(1.0, 1.0))
    assert "entropy" not in diag.sums


def test_objective_from_config_maps_every_field():
    alg = AlgorithmConfig(
        policy_loss="grpo",
        loss_normalization="sequence",
        eps_low=0.1,
        eps_high=0.3,
        dual_clip=4.0,
        kl_coef=0.05,
        entropy_coef=0.01,
        tis_cap=1.5,
    )
    o = Objective.from_config(alg)
    assert o == Objective(grpo_loss, sequence_mean, ClipConfig(0.1, 0.3, 4.0), 0.05, 0.01, 1.5)


def test_policy_loss_and_aggregation_resolvers_reject_non_functions(monkeypatch):
    assert resolve_policy_loss("gspo") is gspo_loss and resolve_aggregation("constant") is constant_norm
    mod = types.ModuleType("tirl_mutants_loss")
    mod.value = 1
    monkeypatch.setitem(sys.modules, "tirl_mutants_loss", mod)
    with pytest.raises(ValueError) as err:
        resolve_policy_loss("tirl_mutants_loss:value")
    assert str(err.value) == (
        "policy loss 'tirl_mutants_loss:value' is not a function (PolicyInputs, ClipConfig) -> TokenLoss"
    )
    with pytest.raises(ValueError) as err:
        resolve_aggregation("tirl_mutants_loss:value")
    assert str(err.value) == (
        "loss normalization 'tirl_mutants_loss:value' is not a function (values, mask, BatchCounts) -> loss"
    )
    with pytest.raises(PluginError, match="unknown policy loss 'x'"):
        resolve_policy_loss("x")
    with pytest.raises(PluginError, match="unknown loss normalization 'x'"):
        resolve_aggregation("x")


# ---- differences of log-probs (never sums), with log-probs away from 0 ----


def test_ratios_and_kl_are_differences_of_log_probs():
    old = t([[-1.0, -2.0, -0.5]])
    lp = old + t([[math.log(1.1), math.log(0.9), 0.0]])
    mask = t([[1, 1, 1]])
    s = math.exp((math.log(1.1) + math.log(0.9)) / 3)
    ratio = gspo_loss(PolicyInputs(lp, old, t([1.0]), mask), ClipConfig(10.0, 10.0)).ratio
    assert ratio.flatten().tolist() == pytest.approx([s] * 3, rel=1e-12)
    _, diag = Objective()(PolicyInputs(lp, old, t([1.0]), mask), BatchCounts(3.0, 1.0))
    assert diag.sums["approx_kl"] == pytest.approx(sum((r - 1) - math.log(r) for r in (1.1, 0.9, 1.0)))
    ref = lp + t([[math.log(0.5), 0.0, math.log(2.0)]])
    assert kl_k3(lp, ref)[0].tolist() == pytest.approx([0.5 - math.log(0.5) - 1, 0.0, 2 - math.log(2) - 1])


def test_approx_kl_log_ratio_is_bounded_at_20_both_ways():
    old = t([[-1.0, -1.0]])
    lp = old + t([[30.0, -30.0]])
    _, diag = Objective(clip=ClipConfig(100.0, 1e12))(
        PolicyInputs(lp, old, t([1.0]), t([[1, 1]])), BatchCounts(2, 1)
    )
    assert diag.sums["approx_kl"] == pytest.approx((math.expm1(20) - 20) + (math.expm1(-20) + 20), rel=1e-12)


def test_flags_are_booleans_with_or_without_the_dual_clip():
    ratio, adv = t([[0.5, 2.0]]), t([[-1.0, 1.0]])
    for clip in (ClipConfig(), ClipConfig(dual_clip=3.0)):
        tl = clipped_surrogate(ratio, adv, clip)
        assert tl.clipped_low.dtype == tl.clipped_high.dtype == tl.dual_clipped.dtype == torch.bool


def test_the_tis_weight_keeps_the_losses_dtype():
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float32)
    engine = torch.tensor([[-1.5, -2.0]], dtype=F64)  # the engine's log-probs in another precision
    inputs = PolicyInputs(lp, lp.clone(), torch.tensor([1.0]), torch.tensor([[1, 1]]), engine)
    loss, _ = Objective(tis_cap=2.0)(inputs, BatchCounts(2.0, 1.0))
    assert loss.dtype == torch.float32
