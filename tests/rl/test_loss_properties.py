"""Invariants of the objective over many random inputs (hypothesis), so that a planted bug in an
aggregation, a clip or an estimator fails whatever example it hides behind:
- every aggregation adds up over micro-batches to exactly the whole batch's loss (the global counts);
- the clipped surrogate is sign-symmetric: a token's loss under -A mirrors its loss under A with the
  clip sides swapped; the dual clip only ever touches negative advantages;
- the gradient never flows through the constant parts (old log-probs, advantages, TIS weights);
- advantages are centred, shift-invariant, and zero for a group without relative signal.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tirl.rl.advantages import dr_grpo, grpo
from tirl.rl.losses import (
    AGGREGATIONS,
    BatchCounts,
    ClipConfig,
    Objective,
    PolicyInputs,
    clipped_surrogate,
    grpo_loss,
    gspo_loss,
)

FAST = settings(max_examples=60, deadline=None)


@st.composite
def batches(draw, max_b: int = 6, max_t: int = 9):
    """A batch of B trajectories of T tokens: log-probs near each other, a mask with at least one
    trained token per batch, an advantage per trajectory."""
    b, t = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    new = old + torch.randn(b, t, generator=g, dtype=torch.float64) * draw(st.sampled_from([0.01, 0.2, 1.0]))
    mask = (torch.rand(b, t, generator=g) < draw(st.floats(0.2, 1.0))).double()
    mask[0, 0] = 1.0
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    engine = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    return new, old, mask, adv, engine


def _inputs(new, old, mask, adv, engine=None, grad=False) -> PolicyInputs:
    lp = new.clone().requires_grad_(grad)
    return PolicyInputs(lp, old, adv, mask, engine)


@FAST
@given(batches(), st.sampled_from(sorted(AGGREGATIONS)), st.integers(1, 4), st.sampled_from([None, 2.0]))
def test_micro_batches_add_up_to_the_whole_batch(batch, aggregation, parts, tis_cap):
    """The sum over micro-batches of each one's loss (global counts) is the whole batch's loss, for
    every aggregation: Dr.GRPO's constant normalizer too (it must not depend on the micro-batch)."""
    new, old, mask, adv, engine = batch
    objective = Objective(aggregate=AGGREGATIONS[aggregation], tis_cap=tis_cap)
    counts = BatchCounts(float(mask.sum()), float(mask.shape[0]), loss_constant=7.0)
    whole, _ = objective(_inputs(new, old, mask, adv, engine), counts)
    summed = sum(
        objective(
            _inputs(new[i::parts], old[i::parts], mask[i::parts], adv[i::parts], engine[i::parts]), counts
        )[0]
        for i in range(min(parts, new.shape[0]))
    )
    assert float(summed) == pytest.approx(float(whole), rel=1e-9, abs=1e-12)


@FAST
@given(batches(), st.floats(0.05, 0.4), st.floats(0.05, 0.4))
def test_the_clip_is_sign_symmetric(batch, eps_low, eps_high):
    """loss(rho, -A) with (eps_low, eps_high) equals -A * ... mirrored: flipping the advantage's sign
    swaps which clip side binds, and the clipped-token flags swap with it."""
    new, old, _, adv, _ = batch
    ratio = torch.exp(new - old)
    a = adv.unsqueeze(-1).expand_as(ratio)
    pos = clipped_surrogate(ratio, a.abs(), ClipConfig(eps_low, eps_high))
    neg = clipped_surrogate(ratio, -a.abs(), ClipConfig(eps_low, eps_high))
    # -min(rho*A, clip(rho)*A) for A > 0 is -A*min(rho, clip(rho)); for -A it is A*max(rho, clip(rho))
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    assert torch.allclose(pos.loss, -a.abs() * torch.minimum(ratio, clipped))
    assert torch.allclose(neg.loss, a.abs() * torch.maximum(ratio, clipped))
    assert not pos.clipped_low.any() and not neg.clipped_high.any()
    assert torch.equal(pos.clipped_high, ratio > 1 + eps_high)
    assert torch.equal(neg.clipped_low, ratio < 1 - eps_low)


@FAST
@given(batches(), st.floats(1.5, 5.0))
def test_the_dual_clip_touches_only_negative_advantages(batch, c):
    new, old, _, adv, _ = batch
    ratio = torch.exp((new - old) * 4)  # some ratios far above c
    a = adv.unsqueeze(-1).expand_as(ratio)
    plain = clipped_surrogate(ratio, a, ClipConfig())
    dual = clipped_surrogate(ratio, a, ClipConfig(dual_clip=c))
    positive = a > 0
    assert torch.equal(dual.loss[positive], plain.loss[positive])
    assert not dual.dual_clipped[positive].any()
    # on A < 0 the loss is bounded by -c*A, and changed exactly where it was above the bound
    bound = -c * a
    assert torch.all(dual.loss[~positive] <= bound[~positive] + 1e-12)
    assert torch.equal(dual.dual_clipped, ~positive & (plain.loss > bound))


@FAST
@given(batches(), st.sampled_from(["grpo", "gspo"]), st.sampled_from(sorted(AGGREGATIONS)))
def test_gradients_flow_only_through_the_current_log_probs(batch, loss_name, aggregation):
    """The TIS weight is a constant (no gradient reaches the engine's log-probs) that scales each
    token's gradient; untrained tokens get none."""
    new, old, mask, adv, engine = batch
    policy_loss = {"grpo": grpo_loss, "gspo": gspo_loss}[loss_name]

    def grad(tis_cap, engine_lp):
        inputs = PolicyInputs(new.clone().requires_grad_(), old, adv, mask, engine_lp)
        objective = Objective(policy_loss=policy_loss, aggregate=AGGREGATIONS[aggregation], tis_cap=tis_cap)
        objective(inputs, BatchCounts.of(mask))[0].backward()
        return inputs.logprobs.grad

    engine_ = engine.clone().requires_grad_()
    with_tis = grad(2.0, engine_)
    assert engine_.grad is None or not engine_.grad.any()
    assert not with_tis[mask == 0].any()
    if loss_name == "grpo":  # per-token ratio: each token's gradient is scaled by its own weight
        weight = torch.exp(old - engine).clamp(max=2.0)
        assert torch.allclose(with_tis, grad(None, engine) * weight, atol=1e-12)


@FAST
@given(st.lists(st.sampled_from([0.0, 1.0]), min_size=1, max_size=32), st.floats(-3, 3))
def test_advantages_are_centred_and_shift_invariant(rewards, shift):
    for estimator in (grpo, dr_grpo):
        a = estimator(rewards)
        assert len(a) == len(rewards)
        assert sum(a) == pytest.approx(0.0, abs=1e-9)
        assert estimator([r + shift for r in rewards]) == pytest.approx(a, abs=1e-9)
        if len(set(rewards)) == 1:
            assert a == [0.0] * len(rewards)
    if len(set(rewards)) > 1:  # GRPO scales to unit (sample) std; Dr.GRPO keeps the reward scale
        assert torch.tensor(grpo(rewards), dtype=torch.float64).std() == pytest.approx(1.0, rel=1e-4)
        assert dr_grpo([2 * r for r in rewards]) == pytest.approx([2 * x for x in dr_grpo(rewards)])
