"""The training objective: policy losses, how their tokens are aggregated, KL and entropy terms.

Tensors are [batch, tokens]; `mask` is 1 on the tokens trained on (generated tokens, never tool
responses or padding). The objective of one micro-batch is

    aggregate(policy_loss(inputs)) + kl_coef * aggregate(KL) - entropy_coef * aggregate(entropy)

Policy losses (`algorithm.policy_loss`, POLICY_LOSSES or a `module:function` path) map PolicyInputs
and the clip settings to a per-token loss (TokenLoss) plus the ratio and which tokens were clipped:

- "grpo" (the paper): min(rho*A, clip(rho, 1-eps_low, 1+eps_high)*A) per token, rho = pi/pi_old
  ("clip-higher": eps_high > eps_low).
- "gspo" (GSPO, Zheng et al. 2025): the same clip on the SEQUENCE ratio s_i = exp(mean_t log rho_t),
  written per token as sg[s_i] * pi_t / sg[pi_t] so the gradient is GSPO's; its natural aggregation
  is "sequence" and its clip range is ~1e-3 (the paper: eps 3e-4 / 4e-4), not GRPO's 0.2.

`dual_clip` (Ye et al. 2020) bounds the loss of a negative-advantage token whose ratio exploded:
the surrogate is max(min(...), dual_clip * A) when A < 0. Off by default (the paper has none).

Aggregations (`algorithm.loss_normalization`, AGGREGATIONS), all dividing by GLOBAL counts so that
micro-batches and data-parallel ranks add up to exactly the loss of the whole batch:

- "token" (the paper): sum over all trained tokens / number of trained tokens.
- "sequence": each trajectory's token mean, summed / number of trajectories.
- "constant" (Dr.GRPO): each trajectory's token SUM / loss_constant, summed / number of trajectories:
  no length bias (a long wrong answer is not penalized less per token than a short one).

Every term reports diagnostics as sums (or maxes) over tokens, so the trainer can add them over
micro-batches and ranks and divide once: clip fractions, the ratio's mean and max, approx_kl
(E[(rho - 1) - log rho] against the rollout policy, as CleanRL), entropy, KL to the reference.

Off-policy correction (`algorithm.tis_cap`, off by default): the per-token loss is multiplied, before
aggregation, by the detached truncated importance weight min(pi_old / mu, cap) against the engine's
sampling log-probs mu (tirl.rl.importance), with its diagnostics (weight mean, ratio max, fraction
truncated).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tirl.plugins import resolve
from tirl.rl.importance import truncated_is_weights

_MAX_LOG_RATIO = 20.0  # a numerically huge ratio would be clipped anyway but can overflow to inf


@dataclass
class PolicyInputs:
    logprobs: torch.Tensor  # [B, T] current policy, with gradient
    old_logprobs: torch.Tensor  # [B, T] the policy that sampled (recomputed by the trainer)
    advantages: torch.Tensor  # [B] one per trajectory, or [B, T] per token
    mask: torch.Tensor  # [B, T] 1 = trained on
    engine_logprobs: torch.Tensor | None = None  # [B, T] the engine's sampling log-probs (for TIS)

    def __post_init__(self) -> None:
        self.mask = self.mask.to(self.logprobs.dtype)
        adv = self.advantages.to(self.logprobs.dtype)
        self.advantages = adv.unsqueeze(-1).expand_as(self.logprobs) if adv.dim() == 1 else adv


@dataclass(frozen=True)
class ClipConfig:
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = None  # c > 1: bound on -rho*A for A < 0


@dataclass
class TokenLoss:
    """What a policy loss returns: the per-token loss to minimize and what its clip did."""

    loss: torch.Tensor  # [B, T] before aggregation
    ratio: torch.Tensor  # [B, T] the importance ratio the loss used
    clipped_low: torch.Tensor  # [B, T] bool: gradient removed at 1 - eps_low
    clipped_high: torch.Tensor  # [B, T] bool: gradient removed at 1 + eps_high
    dual_clipped: torch.Tensor  # [B, T] bool: bounded by the dual clip


PolicyLoss = Callable[[PolicyInputs, ClipConfig], TokenLoss]


def clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, clip: ClipConfig) -> TokenLoss:
    """-min(rho*A, clip(rho)*A) per token, with the optional dual clip for A < 0."""
    clipped = ratio.clamp(1.0 - clip.eps_low, 1.0 + clip.eps_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    dual = torch.zeros_like(ratio, dtype=torch.bool)
    if clip.dual_clip is not None:
        bound = clip.dual_clip * adv
        dual = (adv < 0) & (surrogate < bound)
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, bound), surrogate)
    with torch.no_grad():
        low = (adv < 0) & (ratio < 1.0 - clip.eps_low)
        high = (adv > 0) & (ratio > 1.0 + clip.eps_high)
    return TokenLoss(-surrogate, ratio.detach(), low, high, dual)


def grpo_loss(inputs: PolicyInputs, clip: ClipConfig) -> TokenLoss:
    """The paper's token-level ratio pi_t / pi_old_t."""
    log_ratio = (inputs.logprobs - inputs.old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return clipped_surrogate(torch.exp(log_ratio), inputs.advantages, clip)


def gspo_loss(inputs: PolicyInputs, clip: ClipConfig) -> TokenLoss:
    """GSPO's sequence ratio s_i = exp(mean over trained tokens of log rho), one per trajectory."""
    log_ratio = (inputs.logprobs - inputs.old_logprobs) * inputs.mask
    seq = log_ratio.sum(-1) / inputs.mask.sum(-1).clamp(min=1.0)
    per_token = seq.detach().unsqueeze(-1) + inputs.logprobs - inputs.logprobs.detach()
    ratio = torch.exp(per_token.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    return clipped_surrogate(ratio, inputs.advantages, clip)


POLICY_LOSSES: dict[str, PolicyLoss] = {"grpo": grpo_loss, "gspo": gspo_loss}


@dataclass(frozen=True)
class BatchCounts:
    """Global denominators of one optimizer update (all its micro-batches on all ranks)."""

    tokens: float  # trained tokens
    sequences: float  # trajectories
    loss_constant: float = 1.0  # "constant" aggregation: tokens per trajectory it divides by

    @classmethod
    def of(cls, mask: torch.Tensor, loss_constant: float = 1.0) -> BatchCounts:
        """The counts of one batch on its own (when it is the whole update)."""
        return cls(max(float(mask.sum()), 1.0), max(float(mask.shape[0]), 1.0), loss_constant)


Aggregation = Callable[[torch.Tensor, torch.Tensor, BatchCounts], torch.Tensor]


def token_mean(values: torch.Tensor, mask: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    return (values * mask).sum() / counts.tokens


def sequence_mean(values: torch.Tensor, mask: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_seq.sum() / counts.sequences


def constant_norm(values: torch.Tensor, mask: torch.Tensor, counts: BatchCounts) -> torch.Tensor:
    return (values * mask).sum() / (counts.loss_constant * counts.sequences)


AGGREGATIONS: dict[str, Aggregation] = {
    "token": token_mean,
    "sequence": sequence_mean,
    "constant": constant_norm,
}


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate (Schulman's k3: unbiased, always >= 0). Off by default."""
    log_ratio = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(log_ratio) - log_ratio - 1.0


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy of the policy's distribution (for the metric and the optional bonus)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


@dataclass
class Diagnostics:
    """Sums (and maxes) over trained tokens, added over micro-batches and ranks, divided once."""

    sums: dict[str, float] = field(default_factory=dict)
    maxes: dict[str, float] = field(default_factory=dict)

    def add(self, other: Diagnostics) -> None:
        for k, v in other.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        for k, v in other.maxes.items():
            self.maxes[k] = max(self.maxes.get(k, v), v)

    def per_token(self, tokens: float) -> dict[str, float]:
        """train/... metrics: each sum divided by the trained tokens, maxes as they are."""
        t = max(tokens, 1.0)
        out = {f"train/{k}": v / t for k, v in self.sums.items()}
        out |= {f"train/{k}": v for k, v in self.maxes.items()}
        if "train/clip_frac_low" in out and "train/clip_frac_high" in out:
            out["train/clip_frac"] = out["train/clip_frac_low"] + out["train/clip_frac_high"]
        return out


def _masked(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values.detach().to(mask.dtype) * mask).sum())


@dataclass(frozen=True)
class Objective:
    """The whole loss of one micro-batch and its diagnostics; built from the algorithm config."""

    policy_loss: PolicyLoss = grpo_loss
    aggregate: Aggregation = token_mean
    clip: ClipConfig = ClipConfig()
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    tis_cap: float | None = None  # truncated importance sampling against the engine; None: off

    @classmethod
    def from_config(cls, alg) -> Objective:
        """From tirl.rl.config.AlgorithmConfig (names already validated there)."""
        return cls(
            resolve_policy_loss(alg.policy_loss),
            resolve_aggregation(alg.loss_normalization),
            ClipConfig(alg.eps_low, alg.eps_high, alg.dual_clip),
            alg.kl_coef,
            alg.entropy_coef,
            alg.tis_cap,
        )

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef != 0.0

    def __call__(
        self,
        inputs: PolicyInputs,
        counts: BatchCounts,
        entropy: torch.Tensor | None = None,
        ref_logprobs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Diagnostics]:
        mask = inputs.mask
        tl = self.policy_loss(inputs, self.clip)
        token_loss = tl.loss
        if self.tis_cap is not None:
            if inputs.engine_logprobs is None:
                raise ValueError("tis_cap is set but the batch has no engine log-probs")
            tis = truncated_is_weights(inputs.old_logprobs, inputs.engine_logprobs, mask, self.tis_cap)
            token_loss = token_loss * tis.weight.to(token_loss.dtype)
        loss = self.aggregate(token_loss, mask, counts)
        with torch.no_grad():
            ratio = tl.ratio.to(mask.dtype)
            log_ratio = (
                (inputs.logprobs - inputs.old_logprobs).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
            )
            trained = mask.bool()
            diag = Diagnostics(
                sums={
                    "clip_frac_low": _masked(tl.clipped_low, mask),
                    "clip_frac_high": _masked(tl.clipped_high, mask),
                    "dual_clip_frac": _masked(tl.dual_clipped, mask),
                    "ratio_mean": _masked(ratio, mask),
                    "approx_kl": _masked(torch.expm1(log_ratio) - log_ratio, mask),
                },
                maxes={"ratio_max": float(ratio[trained].max()) if trained.any() else 1.0},
            )
            if self.tis_cap is not None:
                diag.sums["tis_weight_mean"] = _masked(tis.weight, mask)
                diag.sums["tis_truncated_frac"] = _masked(tis.truncated, mask)
                diag.maxes["tis_ratio_max"] = float(tis.ratio[trained].max()) if trained.any() else 1.0
        if self.kl_coef:
            if ref_logprobs is None:
                raise ValueError("kl_coef > 0 needs the reference policy's log-probs")
            kl = kl_k3(inputs.logprobs, ref_logprobs)
            diag.sums["kl"] = _masked(kl, mask)
            loss = loss + self.kl_coef * self.aggregate(kl, mask, counts)
        if entropy is not None:
            diag.sums["entropy"] = _masked(entropy, mask)
            if self.entropy_coef:
                loss = loss - self.entropy_coef * self.aggregate(entropy, mask, counts)
        return loss, diag


def resolve_policy_loss(spec: str) -> PolicyLoss:
    fn = resolve("policy loss", POLICY_LOSSES, spec)
    if not callable(fn):
        raise ValueError(f"policy loss {spec!r} is not a function (PolicyInputs, ClipConfig) -> TokenLoss")
    return fn


def resolve_aggregation(spec: str) -> Aggregation:
    fn = resolve("loss normalization", AGGREGATIONS, spec)
    if not callable(fn):
        raise ValueError(f"loss normalization {spec!r} is not a function (values, mask, BatchCounts) -> loss")
    return fn
