"""Off-policy correction: truncated importance sampling (TIS) against the engine's behaviour policy.

The clipped surrogate's ratio rho = pi / pi_old uses the trainer's own recomputed log-probs as
pi_old (the "proximal" policy of decoupled PPO, Hilton et al. 2022). The tokens were sampled by the
inference engine, whose policy differs from pi_old: by numerics (bf16 kernels, a different attention
implementation) in synchronous training, and by up to `max_staleness` weight versions in asynchronous
training. TIS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training"; Espeholt et al. 2018 for the truncation) weights every trained token by

    w_t = min(exp(log pi_old(y_t) - log mu(y_t)), C)        (detached: a weight, not a gradient path)

where mu is the engine's sampling log-prob and C = `algorithm.tis_cap`. Truncation bounds the variance
a token the engine found unlikely would otherwise add, at the price of a small bias.

Which log-probs: behaviour mu = the engine's log-prob of the token at the moment it sampled it (what the
engines really held, even when a sync landed mid-turn); proximal pi_old = the trainer's recomputation
before the step's first optimizer update, shared by all `mini_batches` of the step (so the weight is
fixed over the step, and the clipped ratio pi / pi_old moves with each mini-batch). The weight is per
token, truncated per token.

Departure from the paper: rStar2-Agent trains synchronously and has no correction; TIS is off for
synchronous training (tis_cap=None) so the paper's recipe is unchanged. With `algorithm.async` and
max_staleness >= 1 it is ON by default (C = 2, the literature's; tirl.rl.config.ASYNC_TIS_CAP): without
it the demo collapsed (docs/results-async.md); `algorithm.tis_cap=null` opts out, with a warning. Also
turn it on with engines whose numerics differ from the trainer's (bf16 vLLM on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MAX_LOG_WEIGHT = 20.0  # exp(20) is already far past any sensible cap; beyond it exp can overflow


@dataclass
class ISWeights:
    weight: torch.Tensor  # [B, T] min(exp(old - engine), cap), detached; min(1, cap) where not trained
    ratio: torch.Tensor  # [B, T] exp(old - engine) before truncation, detached; 1 where not trained
    truncated: torch.Tensor  # [B, T] bool: ratio > cap (the weight was truncated to the cap)


def truncated_is_weights(
    old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> ISWeights:
    """Per-token TIS weights of the trained tokens (`mask` 1). Untrained tokens get ratio 1, so weight
    min(1, cap) (1 for any cap >= 1, the cap below it) and are never counted as truncated; the loss's
    mask zeroes them either way."""
    if cap <= 0:
        raise ValueError(f"the TIS cap must be > 0, got {cap}")
    with torch.no_grad():
        log_ratio = (old_logprobs - engine_logprobs).clamp(-_MAX_LOG_WEIGHT, _MAX_LOG_WEIGHT)
        trained = mask.bool()
        ratio = torch.where(trained, torch.exp(log_ratio), torch.ones_like(log_ratio))
        truncated = ratio > cap
        return ISWeights(ratio.clamp(max=cap), ratio, truncated & trained)
