"""Behaviour of the objective's edges that the hand-computed and property tests leave open: exact
boundaries of each clip and flag, the numeric guards (log-ratio bounds, empty rows, zero counts),
default settings, every diagnostic's value, and the registries' errors. Advantages, TIS weights and
the losses (tirl.rl.advantages, tirl.rl.importance, tirl.rl.losses); see docs/mutation.md."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tirl.plugins import PluginError
from tirl.rl.advantages import ADVANTAGES, dr_grpo, grpo, resolve_advantage
from tirl.rl.config import AlgorithmConfig
from tirl.rl.importance import truncated_is_weights
from tirl.rl.losses import (
    AGGREGATIONS,
    HEAD_CHUNK_BYTES,
    BatchCounts,
    ClipConfig,
    Diagnostics,
    Objective,
    PolicyInputs,
    chunked_logprobs,
    clipped_surrogate,
    constant_norm,
    entropy_from_logits,
    grpo_loss,
    gspo_loss,
    head_chunk_tokens,
    kl_k3,
    resolve_aggregation,
    resolve_policy_loss,
    sequence_mean,
    token_mean,
)

F64 = torch.float64


def t(rows, dtype=F64) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


# ---- advantages ----


def test_a_group_of_two_already_has_a_relative_signal():
    # mean 0.5, unbiased std sqrt(0.5): +-0.5 / 0.7071 = +-0.7071
    assert grpo([1.0, 0.0]) == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5)], abs=1e-5)
    assert dr_grpo([1.0, 0.0]) == [0.5, -0.5]
    assert grpo([3.0]) == [0.0] and dr_grpo([3.0]) == [0.0]
    assert grpo([]) == [] and dr_grpo([]) == []


def test_grpo_divides_by_the_sample_std_plus_a_tiny_eps():
    # rewards 2, 0: std sqrt(2); the eps (1e-6) is negligible but present
    assert grpo([2.0, 0.0])[0] == pytest.approx(1 / (math.sqrt(2) + 1e-6), rel=1e-12)
    assert grpo([2.0, 0.0], eps=1.0)[0] == pytest.approx(1 / (math.sqrt(2) + 1.0), rel=1e-12)


def test_advantages_are_computed_in_double_precision():
    # 1e9 + 1 is not a float32: a single-precision centring would lose the difference
    assert dr_grpo([1e9 + 1, 1e9]) == [0.5, -0.5]
    assert grpo([1e9 + 1, 1e9]) == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5)], abs=1e-5)


def test_resolve_advantage_by_name_by_path_and_rejects_non_functions(monkeypatch):
    assert resolve_advantage("grpo") is grpo and resolve_advantage("dr_grpo") is dr_grpo
    assert {"grpo": grpo, "dr_grpo": dr_grpo} == ADVANTAGES
    mod = types.ModuleType("tirl_mutants_adv")
    mod.fn = lambda rewards: [1.0] * len(rewards)
    mod.value = 3
    monkeypatch.setitem(sys.modules, "tirl_mutants_adv", mod)
    assert resolve_advantage("tirl_mutants_adv:fn") is mod.fn
    with pytest.raises(ValueError) as err:
        resolve_advantage("tirl_mutants_adv:value")
    assert str(err.value) == (
        "advantage estimator 'tirl_mutants_adv:value' is not a function (rewards) -> advantages"
    )
    with pytest.raises(PluginError, match="unknown advantage estimator 'x'"):
        resolve_advantage("x")


# ---- truncated importance weights ----


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


# ---- the chunked loss head (chunked_logprobs, head_chunk_tokens): what every update goes through ----


def _head_inputs(dtype: torch.dtype = F64, b: int = 2, t: int = 5, h: int = 3, v: int = 11, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g, dtype=F64).to(dtype)
    weight = torch.randn(v, h, generator=g, dtype=F64).to(dtype)
    targets = torch.randint(0, v, (b, t), generator=g)
    a, c = torch.randn(b, t, generator=g, dtype=F64), torch.randn(b, t, generator=g, dtype=F64)
    return hidden, weight, targets, a, c


def _head_reference(hidden, weight, targets):
    """log p(target) and the entropy from the full logits, in float64."""
    logp = torch.log_softmax(hidden.double() @ weight.double().t(), -1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _head_loss(fn, hidden, weight, targets, a, c, terms: str, grads: tuple[bool, bool]):
    """Values and the leaves' gradients of sum(a * log p) and/or sum(c * entropy) through `fn`."""
    hidden = hidden.detach().clone().requires_grad_(grads[0])
    weight = weight.detach().clone().requires_grad_(grads[1])
    logprobs, entropy = fn(hidden, weight, targets)
    loss = 0.0
    if "logprobs" in terms:
        loss = loss + (logprobs.double() * a).sum()
    if "entropy" in terms:
        loss = loss + (entropy.double() * c).sum()
    loss.backward()
    return logprobs, entropy, hidden.grad, weight.grad


@pytest.mark.parametrize("chunk", [0, 1, 3, 10, 64])  # 10 tokens: 0 means 1, 3 does not divide 10
@pytest.mark.parametrize("terms", ["logprobs", "entropy", "logprobs+entropy"])
@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, True)])
def test_chunked_head_values_and_gradients_equal_full_logits(chunk, terms, grads):
    """Log-probs and entropies [B, T] in fp32, and the gradient of each loss term to whichever of
    hidden states and head weight is trained (a frozen one gets none), for any chunk size."""
    inputs = _head_inputs()
    lp, ent, gh, gw = _head_loss(lambda h, w, t: chunked_logprobs(h, w, t, chunk), *inputs, terms, grads)
    ref_lp, ref_ent, ref_gh, ref_gw = _head_loss(_head_reference, *inputs, terms, grads)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (2, 5)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-5)
    for got, want in ((gh, ref_gh), (gw, ref_gw)):
        assert (got is None) == (want is None)
        if want is not None:
            assert got.dtype == F64 and torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("terms", ["logprobs", "entropy", "logprobs+entropy"])
def test_chunked_head_fp32_hidden_states_with_a_bf16_head(terms):
    """Mixed precision: fp32 hidden states meet a bf16 head weight; the matmul runs in bf16, the
    softmax in fp32, and each leaf's gradient keeps its dtype (fp32 hidden, bf16 weight)."""
    hidden, weight, targets, a, c = _head_inputs(torch.float32)
    weight = weight.bfloat16()

    def bf16_logits(h, w, t):  # the stock head: bf16 logits, then fp32
        logp = torch.log_softmax(torch.nn.functional.linear(h.bfloat16(), w).float(), -1)
        return logp.gather(-1, t.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)

    got = _head_loss(
        lambda h, w, t: chunked_logprobs(h, w, t, 3), hidden, weight, targets, a, c, terms, (True, True)
    )
    want = _head_loss(bf16_logits, hidden, weight, targets, a, c, terms, (True, True))
    assert got[2].dtype == torch.float32 and got[3].dtype == torch.bfloat16
    assert torch.allclose(got[0], want[0], atol=1e-5) and torch.allclose(got[1], want[1], atol=1e-5)
    assert torch.allclose(got[2], want[2], rtol=2e-2, atol=2e-2)
    assert torch.allclose(got[3].float(), want[3].float(), rtol=2e-2, atol=2e-2)


def test_under_autocast_the_head_computes_in_the_autocast_dtype_and_leaves_keep_theirs():
    """Inside torch.autocast(bf16) fp32 leaves give exactly what their bf16 copies give outside it;
    the gradients arrive in fp32. Outside autocast nothing is cast (an fp32 head stays fp32-exact)."""
    hidden, weight, targets, a, _ = _head_inputs(torch.float32)
    h32, w32 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = chunked_logprobs(h32, w32, targets, 4)
    (lp.double() * a).sum().backward()
    h16, w16 = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    lp16, _ = chunked_logprobs(h16, w16, targets, 4)
    (lp16.double() * a).sum().backward()
    assert torch.equal(lp, lp16) and lp.dtype == torch.float32
    assert h32.grad.dtype == w32.grad.dtype == torch.float32
    assert torch.equal(h32.grad, h16.grad.float()) and torch.equal(w32.grad, w16.grad.float())
    plain, _ = chunked_logprobs(hidden, weight, targets, 4)
    assert torch.allclose(plain.double(), _head_reference(hidden, weight, targets)[0], atol=1e-5)
    assert not torch.allclose(lp.double(), _head_reference(hidden, weight, targets)[0], atol=1e-5)


class _Ops(TorchDispatchMode):
    """Counts the ops run and records the largest new tensor any of them produces (views of its inputs excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count += 1
        seen = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("chunk", [0, 1])
def test_the_head_holds_one_chunk_of_logits_at_a_time(chunk):
    """Chunks of one token (0 counts as 1): no op, forward or backward, makes a tensor larger than one
    token's logits (the vocabulary; with H = 1 the head weight is no larger)."""
    hidden, weight, targets, a, c = _head_inputs(h=1, v=11)
    hidden.requires_grad_(), weight.requires_grad_()
    with _Ops() as probe:
        logprobs, entropy = chunked_logprobs(hidden, weight, targets, chunk)
        ((logprobs * a).sum() + (entropy * c).sum()).backward()
    assert probe.largest == 11


def test_an_entropy_read_as_a_metric_costs_no_backward_work():
    """With the entropy out of the loss the backward skips its per-chunk gradient work: an entropy in
    the loss at weight 0 runs more ops than there are chunks beyond it (10 chunks of one token)."""
    hidden, weight, targets, a, _ = _head_inputs()

    def backward_ops(with_entropy: bool) -> int:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logprobs, entropy = chunked_logprobs(h, w, targets, 1)
        loss = (logprobs * a).sum() + ((entropy * 0.0).sum() if with_entropy else 0.0)
        with _Ops() as probe:
            loss.backward()
        return probe.count

    assert backward_ops(True) - backward_ops(False) > 10


def test_head_chunk_tokens_fits_fp32_logits_to_the_budget():
    """floor(budget / (4 bytes x vocabulary)) tokens, at least one; by default a 1 GiB budget."""
    assert head_chunk_tokens(1000, 28_000) == 7 and head_chunk_tokens(1000, 31_999) == 7
    assert head_chunk_tokens(1000, 32_000) == 8
    assert head_chunk_tokens(10**6, 10) == 1 and head_chunk_tokens(1000, 0) == 1
    assert head_chunk_tokens(151_936) == 1766 == 2**30 // (4 * 151_936) and HEAD_CHUNK_BYTES == 2**30
    assert isinstance(head_chunk_tokens(1000, 28_000), int)


@pytest.mark.parametrize(
    ("frozen", "b", "t", "h", "v"),
    [("hidden", 2, 8, 3, 5), ("weight", 1, 2, 3, 11)],  # the frozen input is the largest tensor
)
def test_a_frozen_input_gets_no_gradient_buffer(frozen, b, t, h, v):
    """A frozen head weight (LoRA) or frozen hidden states: the backward makes no tensor of the frozen
    input's size (no gradient is computed for it) and still gives the trained one its gradient."""
    hidden, weight, targets, a, c = _head_inputs(b=b, t=t, h=h, v=v)
    hidden.requires_grad_(frozen != "hidden"), weight.requires_grad_(frozen != "weight")
    logprobs, entropy = chunked_logprobs(hidden, weight, targets, 1)
    with _Ops() as probe:
        ((logprobs * a).sum() + (entropy * c).sum()).backward()
    frozen_t, trained = (hidden, weight) if frozen == "hidden" else (weight, hidden)
    assert frozen_t.grad is None and trained.grad is not None
    assert probe.largest < frozen_t.numel()


class _LogitRows(TorchDispatchMode):
    """Counts the rows of logits ([rows, V] matmul outputs) computed."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) and out.shape[-1] == self.vocab:
            self.rows += out.shape[0]
        return out


@pytest.mark.parametrize("chunk", [1, 3, 4, 10, 64])
def test_each_tokens_logits_are_computed_once_forward_and_once_backward(chunk):
    """Chunks do not overlap: forward computes 10 tokens' logits once (10 rows), backward rebuilds
    each once more, whatever the chunk size."""
    hidden, weight, targets, a, c = _head_inputs(h=3, v=11)
    hidden.requires_grad_()
    with _LogitRows(11) as probe:
        logprobs, entropy = chunked_logprobs(hidden, weight, targets, chunk)
    assert probe.rows == 10
    with _LogitRows(11) as probe:
        ((logprobs * a).sum() + (entropy * c).sum()).backward()
    assert probe.rows == 10
