"""GRPO as the paper uses it (docs/method.md §3), in the names docs and tests rely on.

The pieces live in their registries: advantage estimators in tirl.rl.advantages, policy losses,
aggregations, KL and entropy in tirl.rl.losses (where Dr.GRPO, GSPO and the dual clip are too).
This module is the paper's combination: group-normalized advantages and the token-level clipped
surrogate with clip-higher, no KL, no entropy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from tirl.rl import advantages
from tirl.rl.losses import (
    BatchCounts,
    ClipConfig,
    Objective,
    PolicyInputs,
    entropy_from_logits,
    grpo_loss,
    kl_k3,
    resolve_aggregation,
)

__all__ = ["clip_counts", "entropy_from_logits", "group_advantages", "kl_k3", "masked_sum", "policy_loss"]

Normalization = Literal["token", "sequence", "constant"]


def group_advantages(rewards: Sequence[float], normalize_std: bool = True, eps: float = 1e-6) -> list[float]:
    """A_i = (r_i - mean(r)) / std(r) over one kept group ("grpo"); without std: "dr_grpo"."""
    return advantages.grpo(rewards, eps) if normalize_std else advantages.dr_grpo(rewards)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    *,
    normalization: Normalization = "token",
    denominator: float | None = None,
) -> torch.Tensor:
    """Negated clipped surrogate, min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A), to minimize.

    normalization="token": sum over all trained tokens / `denominator` (default: trained tokens here).
    normalization="sequence": each trajectory's token mean, summed / `denominator` (default: number of
    trajectories here). Pass the whole batch's count as `denominator` when this is a micro-batch.
    """
    inputs = PolicyInputs(logprobs, old_logprobs, advantages, mask)
    counts = BatchCounts.of(inputs.mask)
    if denominator is not None:
        counts = BatchCounts(denominator, denominator)
    objective = Objective(grpo_loss, resolve_aggregation(normalization), ClipConfig(eps_low, eps_high))
    return objective(inputs, counts)[0]


def masked_sum(
    values: torch.Tensor, mask: torch.Tensor, normalization: Normalization = "token", denominator=None
) -> torch.Tensor:
    """Masked per-token values aggregated by name (tirl.rl.losses.AGGREGATIONS); `denominator` as in
    policy_loss (default: this batch's own count)."""
    aggregate = resolve_aggregation(normalization)
    mask = mask.to(values.dtype)
    counts = BatchCounts.of(mask) if denominator is None else BatchCounts(denominator, denominator)
    return aggregate(values, mask, counts)


def clip_counts(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> tuple[int, int]:
    """(trained tokens whose gradient the clip removed at 1-eps_low, ... at 1+eps_high)."""
    with torch.no_grad():
        inputs = PolicyInputs(logprobs, old_logprobs, advantages, mask)
        tl = grpo_loss(inputs, ClipConfig(eps_low, eps_high))
        on = inputs.mask.bool()
        return int((tl.clipped_low & on).sum()), int((tl.clipped_high & on).sum())
