"""The trainable policy: an HF causal LM (FSDP2-sharded under torchrun), AdamW, and the LR schedule.

Shared by RL and SFT. Sequences are padded into micro-batches under a token budget; the log-prob of
token t is read from the logits at t-1, so per-token arrays (mask, log-probs) have len(ids) - 1 entries.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tirl.devices import resolve_dtype
from tirl.distributed.groups import (
    DistInfo,
    all_reduce,
    barrier,
    clip_grad_norm,
    export_hf_model,
    load_sharded,
    save_sharded,
    shard_model,
    wait_for_rank_zero,
)
from tirl.rl.checkpoint import finish_checkpoint, set_rng_states, staging_dir, staging_path
from tirl.rl.config import LoraConfig, OptimConfig
from tirl.rl.lora import ADAPTER_DIR, save_adapter
from tirl.rl.losses import PolicyInputs, chunked_logprobs, head_chunk_tokens


@dataclass
class TrainSample:
    input_ids: list[int]  # prompt + response, exactly the sampled tokens
    loss_mask: list[int]  # per predicted token (len(input_ids) - 1): 1 = trained on
    advantage: float = 0.0
    old_logprobs: torch.Tensor | None = None  # per predicted token, recomputed by the trainer
    ref_logprobs: torch.Tensor | None = None  # for the optional KL term
    engine_logprobs: list[float] | None = None  # per predicted token, as the inference engine sampled

    def __post_init__(self) -> None:
        if len(self.loss_mask) != len(self.input_ids) - 1:
            raise ValueError(
                f"loss_mask has {len(self.loss_mask)} entries, expected len(input_ids) - 1 = {len(self.input_ids) - 1}"
            )

    @property
    def num_trained(self) -> int:
        return sum(self.loss_mask)


@dataclass
class MicroBatch:
    samples: list[TrainSample]
    logprobs: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] float
    entropy: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)

    def stack(self, name: str) -> torch.Tensor:
        """Pad a per-token attribute of the samples (old_logprobs, ref_logprobs, engine_logprobs) to [B, T]."""
        out = torch.zeros_like(self.logprobs, dtype=torch.float32)
        for i, s in enumerate(self.samples):
            values = torch.as_tensor(getattr(s, name), dtype=torch.float32)
            out[i, : len(values)] = values
        return out.to(self.logprobs.device)

    def advantages(self) -> torch.Tensor:
        return torch.tensor([s.advantage for s in self.samples], device=self.logprobs.device)

    def policy_inputs(self) -> PolicyInputs:
        """What a policy loss reads (tirl.rl.losses): log-probs now and at sampling, advantages, mask, and
        the engine's sampling log-probs where every sample has them."""
        engine = (
            self.stack("engine_logprobs")
            if all(s.engine_logprobs is not None for s in self.samples)
            else None
        )
        return PolicyInputs(self.logprobs, self.stack("old_logprobs"), self.advantages(), self.mask, engine)


def pack_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group indices so each group's padded size (count * longest) stays within max_tokens.

    Longest first, so sequences of similar length share a batch (little padding); a sequence longer
    than the budget gets a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def lr_factor(step: int, total: int, warmup: int, schedule: str, min_ratio: float = 0.0) -> float:
    """Linear warm-up to 1, then constant or cosine decay to min_ratio at `total` steps."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward, with dropout still off.

    transformers checkpoints a layer only while that layer is in training mode, and `from_pretrained`
    returns the model in eval mode, so turning checkpointing on alone does nothing. `model.train()`
    would fix that but also switch on dropout (attention dropout reads its module's `training` flag),
    which RL must not have: the trainer's log-probs must match the engine's. So only the checkpointed
    layers themselves go to training mode; everything inside them stays in eval mode.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.eval()
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no checkpointable layers: set optim.gradient_checkpointing=false"
        )
    for layer in layers:
        layer.training = True  # not layer.train(): that would recurse into the attention and MLP


class TokenHead(torch.nn.Linear):
    """The HF output projection (same weight, same state-dict key) that, while `targeting`, returns
    (per-token log-prob of the target, entropy) from the chunked head instead of full logits.

    It stays inside the model's own forward so FSDP2 has the root's weights gathered around it, as for
    the stock head; the HF forward hands our pair on as `.logits`. Outside `targeting` it is a Linear.
    """

    _targets: torch.Tensor | None = None
    _chunk: int = 1

    def forward(self, hidden: torch.Tensor):  # type: ignore[override]
        if self._targets is None:
            return super().forward(hidden)
        return chunked_logprobs(hidden, self.weight, self._targets, self._chunk)

    @contextmanager
    def targeting(self, targets: torch.Tensor, chunk_tokens: int) -> Iterator[None]:
        self._targets, self._chunk = targets, chunk_tokens
        try:
            yield
        finally:
            self._targets = None


def install_token_head(model: torch.nn.Module) -> TokenHead:
    """Turn the model's `lm_head` into a TokenHead in place (its class only: parameters, ties and
    state-dict keys stay as they are)."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__} has no linear lm_head to compute log-probs with")
    if not isinstance(head, TokenHead):
        head.__class__ = TokenHead
    return head


def token_logprobs(
    model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of each next token ids[:, 1:] and the entropies there, [B, T-1] fp32 each, through the
    chunked head: full-vocabulary logits exist for one chunk of tokens at a time, never the batch."""
    head = install_token_head(model)
    targets = ids.roll(-1, dims=1)  # position t predicts t+1; the last position's target is unused
    with head.targeting(targets, head_chunk_tokens(head.out_features)):
        logprobs, entropy = model(input_ids=ids, attention_mask=attn).logits
    return logprobs[:, :-1], entropy[:, :-1]


def _load_full_model(model_path: str) -> torch.nn.Module:
    """The whole model in fp32 on the host (one process per run does this)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    except OSError as e:
        raise FileNotFoundError(f"cannot load the policy model from {model_path!r}: {e}") from e


def _prepare(model: torch.nn.Module, optim: OptimConfig) -> torch.nn.Module:
    if optim.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model.config.use_cache = False
    install_token_head(model)
    return model


def _restore_computed_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary inverse frequencies) are in no checkpoint: after a meta-device
    build they are uninitialized, so each owning module is rebuilt small on the host from its config
    and its buffers copied over."""
    for module in model.modules():
        names = getattr(module, "_non_persistent_buffers_set", set())
        if not names:
            continue
        if not hasattr(module, "config"):
            raise ValueError(f"cannot recompute the buffers {sorted(names)} of {type(module).__name__}")
        with torch.device("cpu"):
            fresh = type(module)(module.config)
        for name in names:
            module._buffers[name] = fresh._buffers[name].to(device)


def with_lora(model: torch.nn.Module, lora: LoraConfig, bf16: bool) -> torch.nn.Module:
    """The adapters injected (optim.lora.enabled) and everything else frozen: in bf16 when the run
    computes in bf16 (the base never trains, so it needs no fp32 master copy); the adapters stay fp32."""
    if not lora.enabled:
        return model
    from tirl.rl.lora import apply_lora

    apply_lora(model, lora)
    if bf16:
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    return model


def build_sharded_model(model_path: str, optim: OptimConfig, info: DistInfo, bf16: bool) -> torch.nn.Module:
    """The policy model under FSDP2 without ever holding it whole on an accelerator: built on the meta
    device, sharded, given storage for this rank's shards only, then filled from the checkpoint, which
    rank 0 alone reads from disk (once per run, on the host) and broadcasts shard by shard. With LoRA the
    adapters are injected on the meta device and into rank 0's host copy alike (the same names), and
    rank 0's freshly initialized adapters are what every rank starts from."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_path)
    except OSError as e:
        raise FileNotFoundError(f"cannot load the policy model from {model_path!r}: {e}") from e
    with torch.device("meta"):
        model = _prepare(AutoModelForCausalLM.from_config(config, dtype=torch.float32), optim)
        with_lora(model, optim.lora, bf16)
    shard_model(model, info, bf16)
    model.to_empty(device=info.device)
    _restore_computed_buffers(model, info.device)
    full = with_lora(_load_full_model(model_path), optim.lora, False).state_dict() if info.is_main else {}
    # Rank 0's read takes as long as the storage does: the others wait at its gate, not in the broadcast
    # (whose collective timeout would end the run at start on slow storage).
    wait_for_rank_zero(info)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    return model


class Policy:
    def __init__(self, model_path: str, optim: OptimConfig, info: DistInfo, total_steps: int):
        self.info, self.optim_cfg = info, optim
        self.device = info.device
        self.bf16 = resolve_dtype(optim.dtype, self.device) == torch.bfloat16
        # with LoRA: the frozen base its adapter checkpoints name (absolute, when a local directory)
        self.model_path = str(Path(model_path).resolve()) if Path(model_path).is_dir() else model_path
        self.lora = optim.lora.enabled
        if info.enabled:
            self.model = build_sharded_model(model_path, optim, info, self.bf16)
        else:  # one process: nothing to shard, the model is this process's to place
            model = _prepare(_load_full_model(model_path), optim)
            self.model = with_lora(model, optim.lora, self.bf16).to(self.device)
        self.pad_id = self.model.config.pad_token_id or 0
        self.total_steps = total_steps
        self.reference: torch.nn.Module | None = None
        self.reset_optimizer()

    # ---- optimizer and schedule ----
    def reset_optimizer(self, total_steps: int | None = None) -> None:
        """A fresh AdamW and warm-up (at start and at every RL stage boundary)."""
        o = self.optim_cfg
        self.total_steps = total_steps or self.total_steps
        self.optimizer = torch.optim.AdamW(
            self.trainable_parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay
        )
        warmup = round(o.warmup_ratio * self.total_steps) if o.warmup_ratio is not None else o.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, self.total_steps, warmup, o.schedule, o.min_lr_ratio)
        )

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer updates: every parameter, or with LoRA the adapters only."""
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def step(self) -> float:
        """Clip, apply and clear the accumulated gradients; returns the pre-clip grad norm."""
        norm = clip_grad_norm(self.trainable_parameters(), self.optim_cfg.grad_clip, self.info)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def advance_schedule(self) -> None:
        self.scheduler.step()

    # ---- forward ----
    def forward(self, samples: list[TrainSample], with_entropy: bool = False, model=None) -> MicroBatch:
        """Per-token log-probs (and entropies) of the samples' own tokens, padded to [B, T]."""
        longest = max(len(s.input_ids) for s in samples)
        ids = torch.full((len(samples), longest), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(samples), longest), dtype=torch.long)
        mask = torch.zeros((len(samples), longest - 1), dtype=torch.float32)
        for i, s in enumerate(samples):
            ids[i, : len(s.input_ids)] = torch.tensor(s.input_ids)
            attn[i, : len(s.input_ids)] = 1
            mask[i, : len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.float32)
        ids, attn, mask = ids.to(self.device), attn.to(self.device), mask.to(self.device)
        autocast = self.bf16 and not self.info.enabled  # FSDP2's mixed-precision policy casts itself
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
            logprobs, entropy = token_logprobs(model or self.model, ids, attn)
        # The entropy costs no memory when unused: the head keeps no graph for it (its gradient is
        # computed only when a loss term reads it, i.e. algorithm.entropy_coef > 0).
        return MicroBatch(samples, logprobs, mask, entropy if with_entropy else None)

    def micro_batches(self, samples: list[TrainSample]) -> Iterator[list[TrainSample]]:
        """Micro-batches under the token budget; every rank yields the same count (FSDP collectives
        pair up across ranks), so a rank with less work runs empty batches that train nothing."""
        groups = pack_micro_batches([len(s.input_ids) for s in samples], self.optim_cfg.micro_batch_tokens)
        (count,) = all_reduce([len(groups)], self.info, op="max")
        for g in groups:
            yield [samples[i] for i in g]
        for _ in range(int(count) - len(groups)):
            yield [TrainSample([self.pad_id, self.pad_id], [0], 0.0, torch.zeros(1), torch.zeros(1), [0.0])]

    def snapshot_reference(self) -> None:
        """Freeze a copy of the current policy as the KL reference (single process only)."""
        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)

    @torch.no_grad()
    def compute_logprobs(
        self, samples: list[TrainSample], attr: str = "old_logprobs", reference: bool = False
    ) -> None:
        """Fill `attr` of every sample with the current (or reference) policy's log-probs, no gradient."""
        for chunk in self.micro_batches(samples):
            mb = self.forward(chunk, model=self.reference if reference else None)
            for i, s in enumerate(chunk):
                setattr(s, attr, mb.logprobs[i, : len(s.loss_mask)].float().cpu())

    def accumulate(
        self, samples: list[TrainSample], loss_fn: Callable[[MicroBatch], torch.Tensor], **kw
    ) -> float:
        """Backward loss_fn over all micro-batches (gradient accumulation); returns the summed loss.

        loss_fn must already divide by the GLOBAL denominator; FSDP averages gradients over ranks,
        so the loss is scaled by the world size to turn that average back into the global sum.
        """
        total = 0.0
        for chunk in self.micro_batches(samples):
            loss = loss_fn(self.forward(chunk, **kw))
            (loss * self.info.world_size).backward()
            total += float(loss.detach())
        return total

    # ---- checkpoints ----
    def save(self, run_dir, step: int, tokenizer, trainer_state: dict, keep_last: int) -> None:
        """Checkpoint (a collective): `stage_checkpoint`, then `publish_checkpoint`."""
        self.stage_checkpoint(run_dir, step)
        self.publish_checkpoint(run_dir, step, tokenizer, trainer_state, keep_last)

    def stage_checkpoint(self, run_dir, step: int) -> None:
        """The device-side half (a collective, with the state where FSDP2 sharded it): every rank writes
        its shards of the weights and optimizer into a staging directory, the model is exported for
        Hugging Face a tensor at a time. Nothing is visible until `publish_checkpoint`."""
        if self.info.is_main:
            staging_dir(run_dir, step, "shards")  # one directory all ranks write into
        barrier(self.info)
        tmp = staging_path(run_dir, step, "shards")
        save_sharded(tmp / "shards", self.model, self.optimizer, trainable_only=self.lora)
        if self.lora:  # the adapter (small) and the base it names, not the whole model
            save_adapter(self.model, tmp / ADAPTER_DIR, self.model_path, self.info.is_main)
        else:
            export_hf_model(self.model, tmp / "model", self.info)
        barrier(self.info)

    def publish_checkpoint(self, run_dir, step: int, tokenizer, trainer_state: dict, keep_last: int) -> None:
        """The host-side half: rank 0 adds the small trainer state (schedule, RNG) to the staged
        checkpoint and moves it into place atomically; the other ranks wait for it."""
        if self.info.is_main:
            state = {**trainer_state, "scheduler": self.scheduler.state_dict()}
            model_dir = ADAPTER_DIR if self.lora else "model"
            tmp = staging_path(run_dir, step, "shards")
            finish_checkpoint(run_dir, step, tmp, tokenizer, state, keep_last, model_dir=model_dir)
        barrier(self.info)

    def restore(self, saved: dict) -> None:
        """Weights, optimizer, schedule and RNG of a checkpoint: each rank reads only its own shards.
        (The weights are read again from the shards, not the export: the resume is exact whatever the
        export holds.)"""
        # (A checkpoint from before sharded checkpoints never gets here: load_trainer_state refuses it
        # with the command that converts it, tirl convert-checkpoint.)
        shards = Path(saved["checkpoint"]) / "shards"
        load_sharded(shards, self.model, self.optimizer, trainable_only=self.lora)
        self.scheduler.load_state_dict(saved["scheduler"])
        set_rng_states(saved["rng"])
