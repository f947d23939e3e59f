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


# ---- the loss head: log-probs and entropies without full-vocabulary logits for a whole micro-batch ----
#
# At 32K tokens x 151,936 vocabulary entries one fp32 logits tensor is 20 GB, and autograd through
# log_softmax and the entropy keeps several of them (~121 GB for Qwen3-14B). The head below computes
# the same numbers a few thousand tokens at a time and keeps only the per-token log-sum-exp for backward,
# where each chunk's logits are rebuilt from the hidden states: peak memory is one chunk's logits.

HEAD_CHUNK_BYTES = 2**30  # fp32 logits of one chunk; a few of these live at once (logits, softmax, grad)


def head_chunk_tokens(vocab_size: int, budget_bytes: int = HEAD_CHUNK_BYTES) -> int:
    """Tokens per chunk so one chunk's fp32 logits take about budget_bytes."""
    return max(1, budget_bytes // (4 * vocab_size))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The matmul runs in the weight's dtype (bf16 under mixed precision, as the HF head would), the
    # softmax in fp32: the numbers the unchunked `model(...).logits.float()` path produced.
    return torch.nn.functional.linear(hidden, weight).float()


class _ChunkedHead(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], targets [N]) -> (log p(target) [N], entropy [N]), chunk by chunk.

    Saved for backward: hidden, weight (FSDP re-gathers it as for any linear) and the log-sum-exp;
    backward recomputes each chunk's logits. d log p_y / dz = onehot(y) - p and
    dH / dz = -p * (log p + H), so both outputs' gradients come from one softmax per chunk.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int):  # type: ignore[override]
        logprobs = hidden.new_empty(targets.shape, dtype=torch.float32)
        entropy = torch.empty_like(logprobs)
        lse = torch.empty_like(logprobs)
        for start in range(0, targets.shape[0], chunk):
            end = start + chunk
            z = _chunk_logits(hidden[start:end], weight)
            lse_c = torch.logsumexp(z, dim=-1)
            p = torch.softmax(z, dim=-1)
            lse[start:end] = lse_c
            logprobs[start:end] = z.gather(-1, targets[start:end, None]).squeeze(-1) - lse_c
            entropy[start:end] = lse_c - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.chunk = chunk
        ctx.set_materialize_grads(False)  # an unused entropy (a metric only) costs nothing in backward
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):  # type: ignore[override]
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        # The weight gradient is summed over chunks in fp32 and cast to the weight's dtype once: summed
        # in bf16 it was rounded after every chunk, and at 32 chunks its error against an fp64 reference
        # was 2.4x the unchunked head's (0.0069 vs 0.0029 normwise; fp32: 0.0034 at 32 or 256 chunks,
        # tests/rl/test_losses_head.py). The fp32 [V, H] buffer (2.9 GiB at 14B) is in `tirl plan`'s
        # measured peak: it runs this code.
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for start in range(0, targets.shape[0], ctx.chunk):
            end = start + ctx.chunk
            z = _chunk_logits(hidden[start:end], weight)
            logp = z - lse[start:end, None]
            p = logp.exp()
            dz = torch.zeros_like(z)
            if grad_logprobs is not None:
                g = grad_logprobs[start:end, None]
                dz -= p * g
                dz.scatter_add_(-1, targets[start:end, None], g)
            if grad_entropy is not None:
                dz -= p * (logp + entropy[start:end, None]) * grad_entropy[start:end, None]
            # Both GEMMs take their operands in the weight's dtype (bf16 under mixed precision: tensor
            # cores, half the bytes) and accumulate in fp32 inside the GEMM. In fp32 the casts are
            # no-ops and the weight gradient is summed in place (addmm's beta=1 epilogue) as before.
            dz = dz.to(weight.dtype)
            if grad_weight is not None:
                _accumulate(grad_weight, dz.t(), hidden[start:end])
            if grad_hidden is not None:
                grad_hidden[start:end] = dz @ weight
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


def _accumulate(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total (fp32) += a @ b: in place when a and b are fp32; else their product (one GEMM in their
    dtype, rounded once) added in fp32, one [V, H] temporary of their dtype per chunk."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    else:
        total.add_(a @ b)


def chunked_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob of `targets` and entropy under logits = hidden @ weight.T, never holding more
    than `chunk_tokens` rows of logits. hidden [..., H], targets [...]; returns two fp32 [...] tensors.
    The entropy is differentiable too (for an entropy bonus); left out of the loss it costs nothing."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):  # cast here, where autograd sees it: backward has no autocast
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    shape = targets.shape
    with torch.autocast(device, enabled=False):
        logprobs, entropy = _ChunkedHead.apply(
            hidden.to(weight.dtype).reshape(-1, hidden.shape[-1]),
            weight,
            targets.reshape(-1),
            max(1, chunk_tokens),
        )
    return logprobs.view(shape), entropy.view(shape)


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
