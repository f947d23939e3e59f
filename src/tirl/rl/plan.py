"""`tirl plan`: will a config fit its GPUs? Measured, not guessed, and without a GPU or any weights.

Training memory is measured on the real model architecture: the model is built from its config under
FakeTensorMode (tensors with shapes and dtypes but no storage), sharded with FSDP2 over a fake process
group of the real world size (rank 0's shard sizes are exact), and one micro-batch of the configured
token budget runs forward, backward and the AdamW step through the same code the trainer runs (the
chunked head, gradient checkpointing, the bf16 mixed-precision policy) under FSDP's memory tracker,
with the optimizer state already allocated (the steady state of step 2 onwards).

The inference side is arithmetic on the same architecture: vLLM takes gpu_memory_utilization of the
GPU, its bf16 weights and a profiled activation reserve come off that, and the rest is KV cache; the
plan says how many trajectories of the configured length (engine.max_model_len) fit in it at once.

Colocated (engine i on trainer rank i's GPU, the paper's layout), the GPU must hold, in turn:
  training: the measured peak + allocator slack + CUDA/NCCL context + the sleeping engine's residue;
  rollout:  the trainer's resident state (fp32 master shard + AdamW moments; gradients are freed) +
            its context + the awake engine's whole budget;
  sync:     the woken engine's weights + the trainer's parameter shards + one gathered tensor, and on
            rank 0's GPU under torchrun the whole sync packed in the engines' dtype (the handoff
            buffer engine 0 opens by CUDA IPC: tirl.engines.handoff); Ray's group streams buckets.
The constants below are what the tracker cannot see; each says where it comes from.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

GiB = 2**30

# What FSDP's tracker cannot see, per process on a GPU: the CUDA context and cuBLAS/NCCL workspaces
# (~1 GiB on H100/A100 with NCCL's default buffers), and caching-allocator slack (blocks cached but
# not in use; expandable segments keep it small). Both are conservative round numbers.
TRAINER_CONTEXT = 1.5 * GiB
ALLOCATOR_SLACK = 0.05  # of the measured peak
# A vLLM engine asleep (sleep level 1: weights offloaded to host, KV cache freed) still holds its CUDA
# context and CUDA-graph pool.
ENGINE_ASLEEP = 1.5 * GiB
# vLLM's profiled reserve besides weights and KV cache: the activations of one forward of
# max_num_batched_tokens (8192 for chunked prefill), the sampler's fp32 logits for max_num_seqs, CUDA
# graphs and non-torch memory. Estimated from the architecture in engine_reserve().
ENGINE_BATCHED_TOKENS = 8192
ENGINE_GRAPHS_AND_NON_TORCH = 1.5 * GiB

# Published sizes (config.json of the Hugging Face releases); no hub access is needed.
_QWEN3_COMMON: dict[str, Any] = dict(
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)
# name: (hidden, layers, attention heads, intermediate, tied embeddings)
_QWEN3_SIZES = {
    "qwen3-0.6b": (1024, 28, 16, 3072, True),
    "qwen3-1.7b": (2048, 28, 16, 6144, True),
    "qwen3-4b": (2560, 36, 32, 9728, True),
    "qwen3-8b": (4096, 36, 32, 12288, False),
    "qwen3-14b": (5120, 40, 40, 17408, False),
    "qwen3-32b": (5120, 64, 64, 25600, False),
}
QWEN3: dict[str, dict[str, Any]] = {
    name: _QWEN3_COMMON
    | dict(
        hidden_size=h, num_hidden_layers=n, num_attention_heads=a, intermediate_size=i, tie_word_embeddings=t
    )
    for name, (h, n, a, i, t) in _QWEN3_SIZES.items()
}
QWEN3_14B = QWEN3["qwen3-14b"]
ARCHITECTURES: dict[str, dict[str, Any]] = {
    **QWEN3,
    "Qwen/Qwen3-14B": QWEN3_14B,
    "Qwen/Qwen3-14B-Base": QWEN3_14B,
}


@dataclass(frozen=True)
class ClusterShape:
    gpus: int  # training ranks (FSDP world size); colocated, also the number of engines
    gpu_memory: int  # bytes per GPU
    colocated: bool = True
    # The trainer's state leaves the GPU while the engines generate: what the synchronous trainer does
    # whenever it is colocated (tirl.rl.trainer: optimizer after the update, parameters after the sync).
    trainer_offload: bool = False
    # How a sync reaches the engines (tirl.runtime.base.Runtime.transport): "load", in-process engines
    # (backend local: torchrun or one process), packed once into one buffer; "group", Ray's sync group.
    transport: str = "load"


@dataclass(frozen=True)
class Workload:
    """What one training micro-batch and one engine are asked to hold."""

    micro_batch: tuple[int, int]  # (sequences, tokens each) of the worst micro-batch
    bf16: bool = True
    gradient_checkpointing: bool = True
    engine: dict[str, Any] | None = None  # max_model_len, gpu_memory_utilization, tp, dtype; None = SFT
    lora: dict[str, Any] | None = (
        None  # optim.lora's settings when enabled: adapters train, the base is frozen
    )


@dataclass
class TrainingMemory:
    peak: int  # bytes, as the memory tracker measured the update's steady state on rank 0
    by_category: dict[str, int]
    resident: int  # between steps: (sharded) params + AdamW moments (gradients are set to None)
    trainable: int = 0  # parameters the optimizer updates (all of them; with LoRA the adapters only)

    @property
    def parameter_bytes(self) -> int:
        return self.by_category.get("Sharded Param", 0)


@dataclass
class EngineMemory:
    budget: int  # gpu_memory_utilization x GPU memory, per GPU of the engine
    weights: int  # per GPU (1 / tensor_parallel_size of the model)
    reserve: int
    kv_cache: int
    kv_per_token: int  # per GPU
    trajectory_tokens: int
    trajectories: int  # of trajectory_tokens each, at once


@dataclass
class Plan:
    architecture: str
    parameters: int
    cluster: ClusterShape
    workload: Workload
    training: TrainingMemory
    engine: EngineMemory | None
    sync_bytes: int
    training_total: int  # per GPU while training, all included
    rollout_total: int | None  # per GPU while the engines generate (colocated or engine GPUs)
    sync_total: int | None = None  # colocated: per GPU while the weights move to the woken engine
    slack: float = 0.05  # the allocator allowance on the measured peak (allocator_slack())
    largest_tensor: int = 0  # bytes of the largest tensor the sync makes whole in fp32 (gathered, or merged)
    sync_buffer: int = 0  # bytes of the flat handoff buffer of one packed sync (0: nothing packed whole)
    buffer_on_gpu: bool = False  # that buffer in rank 0's GPU memory (an engine shares that GPU)
    buffer_in_file: bool = False  # and/or one /dev/shm file for the engines on other GPUs
    fits: bool = False
    advice: list[str] = field(default_factory=list)
    fixes: dict[str, str] = field(default_factory=dict)  # config overrides that make it fit (checked)

    def verdict(self) -> str:
        if self.fits:
            return f"FITS: {_gb(self.training_total)} GiB training peak per GPU of {_gb(self.cluster.gpu_memory)} GiB"
        return "DOES NOT FIT: " + "; ".join(self.advice)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"verdict": self.verdict()}

    def _layout(self) -> str:
        c = self.cluster
        if self.engine is None:
            return "training only"
        offload = ", trainer state offloaded to the host during rollouts" if c.trainer_offload else ""
        tp = int(self.workload.engine.get("tensor_parallel_size", 1))
        return f"{'colocated' if c.colocated else 'separate'} engines, tensor parallel {tp}{offload}"

    def lines(self) -> list[str]:
        c, t = self.cluster, self.training
        b, n = self.workload.micro_batch
        out = [
            f"model: {self.architecture}, {self.parameters / 1e9:.2f}B parameters",
            f"cluster: {c.gpus} GPUs x {_gb(c.gpu_memory)} GiB, {self._layout()}",
            f"training (measured: {MICRO_BATCHES} micro-batches of {b} x {n} tokens accumulate, padding "
            f"mask, AdamW step): peak {_gb(t.peak)} GiB per GPU ("
            + ", ".join(f"{k} {_gb(v)}" for k, v in t.by_category.items() if v >= GiB / 100)
            + ")",
            *self._lora_lines(),
            "training per GPU: "
            + _sum(self._training_terms(), self.training_total, c.gpu_memory)
            + f"; resident between steps {_gb(t.resident)} GiB",
        ]
        if self.engine is not None:
            out += self._engine_lines()
        return [*out, self.verdict(), *self._fix_lines()]

    def _lora_lines(self) -> list[str]:
        if not self.workload.lora:
            return []
        t = self.training
        return [
            f"LoRA: rank {self.workload.lora['rank']}, {t.trainable / 1e6:.2f}M trainable parameters "
            f"({100 * t.trainable / max(self.parameters, 1):.2f}%); gradients and AdamW state for "
            "them only, the frozen base in the compute dtype"
        ]

    def _training_terms(self) -> list[tuple[str, int]]:
        peak = self.training.peak
        terms = [("measured peak", peak), (f"allocator slack {self.slack:.0%}", int(peak * self.slack))]
        terms.append(("CUDA/NCCL context", int(TRAINER_CONTEXT)))
        if self.cluster.colocated and self.engine is not None:
            terms.append(("sleeping engine", int(ENGINE_ASLEEP)))
        return terms

    def _rollout_terms(self) -> list[tuple[str, int]]:
        terms = [("engine budget", self.engine.budget)]
        if self.cluster.colocated:
            if not self.cluster.trainer_offload:
                terms.append(("trainer state", self.training.resident))
            terms.append(("trainer context", int(TRAINER_CONTEXT)))
        return terms

    def _sync_terms(self) -> list[tuple[str, int]]:
        """Rank 0's GPU, the fullest: it also holds the packed sync when engine 0 shares it."""
        terms = [
            ("engine weights", self.engine.weights),
            ("engine context", int(ENGINE_ASLEEP)),
            ("trainer parameters", self.training.parameter_bytes),
        ]
        if self.largest_tensor:
            terms.append(("one gathered fp32 tensor", self.largest_tensor))
        if self.buffer_on_gpu:
            terms.append(("sync buffer (the synced weights packed whole)", self.sync_buffer))
        return [*terms, ("trainer context", int(TRAINER_CONTEXT))]

    def _sync_line(self) -> str:
        """Where one sync is staged whole, if anywhere: what a /dev/shm or a GPU must have room for."""
        where = []
        if self.buffer_on_gpu:
            where.append("packed whole on rank 0's GPU (engine 0 opens it by CUDA IPC)")
        if self.buffer_in_file:
            file = f"one {_gb(self.sync_buffer)} GiB /dev/shm file on rank 0's host"
            where.append(f"{'and' if where else 'packed whole into'} {file} for the engines on other GPUs")
        if self.cluster.transport == "group":
            where.append("streamed in buckets over the sync group")
        return ", ".join([f"weight sync: {_gb(self.sync_bytes)} GiB per sync", *where])

    def _engine_lines(self) -> list[str]:
        e, c = self.engine, self.cluster
        if e.budget >= e.weights + e.reserve:
            budget = (
                f"engine: budget {_gb(e.budget)} GiB = weights {_gb(e.weights)} + reserve {_gb(e.reserve)} "
                f"+ KV cache {_gb(e.kv_cache)} GiB ({e.kv_per_token // 1024} KiB per token)"
            )
        else:
            budget = (
                f"engine: budget {_gb(e.budget)} GiB is less than its weights {_gb(e.weights)} + reserve "
                f"{_gb(e.reserve)} GiB: no room for a KV cache"
            )
        out = [
            budget,
            f"  {e.trajectories} trajectories of {e.trajectory_tokens} tokens at once per engine "
            f"({e.kv_cache // max(e.kv_per_token, 1)} tokens)",
            "rollout per GPU: " + _sum(self._rollout_terms(), self.rollout_total or 0, c.gpu_memory),
        ]
        if self.sync_total is not None:
            label = "weight sync on rank 0's GPU: " if self.buffer_on_gpu else "weight sync per GPU: "
            out.append(label + _sum(self._sync_terms(), self.sync_total, c.gpu_memory))
        return [*out, self._sync_line()]

    def _fix_lines(self) -> list[str]:
        if not self.fixes:
            return []
        return ["fits with: " + " ".join(f"{k}={v}" for k, v in self.fixes.items())]


def _sum(terms: list[tuple[str, int]], total: int, memory: int) -> str:
    """'a 1.0 + b 2.0 = 3.0 GiB of 80.0': the terms add up to the total as printed."""
    return " + ".join(f"{name} {_gb(v)}" for name, v in terms) + f" = {_gb(total)} GiB of {_gb(memory)}"


def _gb(n: float) -> str:
    return f"{n / GiB:.1f}"


# ---- the architecture ----


def architecture_config(spec: str):
    """A transformers config: a known name (qwen3-14b, Qwen/Qwen3-14B[-Base]) built from its published
    sizes, or a local model / run / checkpoint directory's config.json."""
    from transformers import AutoConfig, Qwen3Config

    if spec in ARCHITECTURES:
        return Qwen3Config(**ARCHITECTURES[spec])
    from tirl.rl.checkpoint import resolve_model_path

    path = resolve_model_path(spec)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"model {spec}: not a local model and not a known architecture ({', '.join(ARCHITECTURES)}); "
            "pass --arch with one of those or a model directory"
        )
    return AutoConfig.from_pretrained(path)


def parameter_count(config) -> int:
    """Parameters of the architecture (tied embeddings counted once), from a meta-device build."""
    model = _meta_model(config)
    return sum(p.numel() for p in model.parameters())


def _meta_model(config) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


# ---- training: FSDP2 on fake tensors and a fake process group ----

# The steady state of an update: the trainer accumulates gradients over the step's micro-batches
# (tirl.rl.policy.Policy.accumulate), so from the second one on its backward runs with the first one's
# gradients held; two micro-batches measure exactly that.
MICRO_BATCHES = 2
# The attention implementation the measurement runs under (registered by register_planned_attention).
PLANNED_ATTENTION = "tirl_plan"


def register_planned_attention() -> None:
    """The GPU trainer's attention, as its memory goes, for fake tensors on the CPU.

    The trainer always passes the padding mask; a micro-batch whose sequences differ in length makes
    transformers materialize it as a [B, 1, T, T] bool mask, so the worst case is measured with the mask
    materialized. On a GPU, SDPA with a mask runs the memory-efficient kernel: it converts the bool mask
    to a [B, 1, T, T] bias in the compute dtype and keeps it for backward, and transformers repeats the
    KV heads (GQA) before the call, but no [T, T] scores exist. The CPU kernel given a mask would build
    the scores (the reference kernel), so the mask and the bias are allocated here and the attention
    itself runs as the fused causal kernel, whose memory is the efficient kernel's."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask(*args, **kwargs):
        return sdpa_mask(*args, **(kwargs | {"allow_is_causal_skip": False}))

    def attention(module, query, key, value, attention_mask, **kwargs):
        groups = getattr(module, "num_key_value_groups", 1)
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
        out, weights = sdpa_attention_forward(module, query, key, value, None, **kwargs)
        if attention_mask is not None:  # the efficient kernel's bias, kept for its backward
            zero = torch.zeros((), dtype=query.dtype)
            bias = torch.where(attention_mask.logical_not(), float("-inf"), zero)  # as torch converts it
            out = _KeepForBackward.apply(out, bias)
        return out, weights

    AttentionInterface.register(PLANNED_ATTENTION, attention)
    AttentionMaskInterface.register(PLANNED_ATTENTION, mask)


class _KeepForBackward(torch.autograd.Function):
    """Identity on `out` that holds `kept` until backward, as a kernel that saves it does."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(kept)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _workload_meta_model(config, workload: Workload) -> torch.nn.Module:
    """The model on meta under the planned attention, with the workload's LoRA adapters injected as
    the trainer does it (tirl.rl.policy.with_lora). Outside FakeTensorMode: peft moves each adapter to
    its layer's device, which fake tensors refuse."""
    from transformers import AutoModelForCausalLM

    register_planned_attention()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=PLANNED_ATTENTION
        )
    if workload.lora:
        from tirl.rl.config import LoraConfig
        from tirl.rl.policy import with_lora

        with_lora(model, LoraConfig(**workload.lora), workload.bf16)
    return model


def _fake_model(config, meta: torch.nn.Module | None = None) -> torch.nn.Module:
    """The model with storage-less parameters on CPU (call under FakeTensorMode). Built on meta
    (or `meta`, built beforehand) and then given fake parameters, which skips the random initialization
    (seconds at 14B)."""
    model = meta if meta is not None else _meta_model(config)
    made: dict[int, torch.nn.Parameter] = {}  # tied parameters stay one object
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
            module._parameters[name] = made[id(p)]
        for name, b in module.named_buffers(recurse=False):
            module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
    return model


def _allocate_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's moments exist from the first step on; create them now so the measured step is a later one."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


_MEASURED: dict[tuple[str, int, str], TrainingMemory] = {}


def measured(config, world: int, workload: Workload) -> TrainingMemory:
    """measure_training, once per (architecture, world, workload) in this process: the fixes and
    --largest plan the same settings more than once."""
    key = (config.to_json_string(), world, repr(workload))
    if key not in _MEASURED:
        _MEASURED[key] = measure_training(config, world, workload)
    return _MEASURED[key]


def measure_training(config, world: int, workload: Workload) -> TrainingMemory:
    """Peak memory of a training update's steady state on rank 0 of `world` ranks (no GPU, no weights):
    MICRO_BATCHES micro-batches of the worst shape accumulate their gradients (the second one's backward
    runs with the first one's gradients held), with the padding mask, then clipping and AdamW's step
    with its moments allocated. One rank is the trainer's single-process path (no FSDP: the whole model,
    bf16 autocast); more are FSDP2 ranks over a fake process group, which this process must not
    already have (the `tirl train` preflight runs it in a subprocess)."""
    if world < 1:
        raise ValueError(f"a plan needs at least one GPU, got {world}")
    meta = _workload_meta_model(config, workload)
    if world == 1:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            return _measure_one_process(config, workload, meta)
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "measure_training needs a process without a process group (run it in a subprocess)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))  # outside fake mode: the mesh is real bookkeeping
        with FakeTensorMode(), warnings.catch_warnings():
            # The token head's (log-prob, entropy) outputs are views; FSDP2 warns that an in-place op
            # on one would skip its hook. Nothing modifies them in place (the trainer neither).
            warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor")
            return _measure_sharded(config, mesh, workload, meta)
    finally:
        dist.destroy_process_group()


def _prepared(config, workload: Workload, meta: torch.nn.Module | None) -> torch.nn.Module:
    """The fake model as tirl.rl.policy._prepare leaves it (checkpointing, no KV cache, the token head)."""
    from tirl.rl.policy import enable_gradient_checkpointing, install_token_head

    model = _fake_model(config, meta)
    model.config.use_cache = False
    if workload.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    install_token_head(model)
    return model


def _measure_sharded(config, mesh, workload: Workload, meta: torch.nn.Module | None = None) -> TrainingMemory:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from tirl.distributed.groups import DistInfo, shard_model

    model = _prepared(config, workload, meta)
    info = DistInfo(0, mesh.size(), torch.device("cpu"))
    shard_model(model, info, workload.bf16, mesh=mesh)
    optimizer, trainable = _optimizer(model)
    ids = torch.zeros(workload.micro_batch, dtype=torch.long)
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((ids,))
    with tracker:
        _update(model, optimizer, trainable, ids, info, False, tracker.reset_mod_stats)
    return _memory(tracker, model, trainable)


def _measure_one_process(config, workload: Workload, meta: torch.nn.Module | None = None) -> TrainingMemory:
    from torch.distributed._tools.mem_tracker import MemTracker

    from tirl.distributed.groups import DistInfo

    model = _prepared(config, workload, meta)
    optimizer, trainable = _optimizer(model)
    ids = torch.zeros(workload.micro_batch, dtype=torch.long)
    tracker = MemTracker()
    for p in model.parameters():  # a frozen (LoRA base) parameter takes no gradient hook: mark it hooked
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NO_HOOK, _NO_HOOK)
    tracker.track_external(model, optimizer, ids)
    with tracker:
        info = DistInfo(0, 1, torch.device("cpu"))
        _update(model, optimizer, trainable, ids, info, workload.bf16, tracker.reset_mod_stats)
    return _memory(tracker, model, trainable)


class _NoHook:
    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def _optimizer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    """AdamW as tirl.rl.policy.Policy makes it, with its moments allocated. foreach=True is what torch
    picks for CUDA tensors (its temporaries are a moment's size); fake CPU tensors would get the
    per-tensor loop."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-6, foreach=True)
    _allocate_adam_state(optimizer)
    return optimizer, trainable


def _update(model, optimizer, trainable, ids: torch.Tensor, info, autocast: bool, next_micro_batch) -> None:
    """One update as tirl.rl.policy.Policy runs it: forward and backward of each micro-batch with its
    padding mask (gradients accumulate), clipping on local shards, the optimizer step.
    `next_micro_batch()` runs before each micro-batch after the first (the tracker's per-module stats
    allow one forward per module; its peak spans them all)."""
    from tirl.distributed.groups import clip_grad_norm
    from tirl.rl.policy import token_logprobs

    attn = torch.ones_like(ids)
    for index in range(MICRO_BATCHES):
        if index:
            next_micro_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logprobs, _ = token_logprobs(model, ids, attn)
        (logprobs.sum() * info.world_size).backward()
    clip_grad_norm(trainable, 1.0, info)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _memory(tracker, model: torch.nn.Module, trainable: list[torch.nn.Parameter]) -> TrainingMemory:
    peak = tracker.get_tracker_snapshot("peak")
    stats = next(iter(peak.values())) if peak else {}
    by_category = {_category(k): int(v) for k, v in stats.items() if k != "Total"}
    # between steps: every parameter's shard, and AdamW's two moments of the trained ones
    resident = sum(_local_bytes(p) for p in model.parameters()) + sum(_local_bytes(p) * 2 for p in trainable)
    count = sum(p.numel() for p in trainable)  # a DTensor counts its whole tensor
    return TrainingMemory(int(stats.get("Total", 0)), by_category, resident, count)


# One process's tracker names its categories as FSDP's does for the same memory.
_ONE_PROCESS_NAMES = {"Parameter": "Sharded Param", "Gradient": "Sharded Grad", "Optstate": "OptState"}


def _category(key) -> str:
    name = getattr(key, "value", str(key))
    return _ONE_PROCESS_NAMES.get(name, name)


def _local_bytes(p: torch.Tensor) -> int:
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.numel() * local.element_size()


# ---- inference: vLLM's memory budget ----


def kv_bytes_per_token(config, dtype_bytes: int = 2, tp: int = 1) -> int:
    """K and V for every layer and KV head, on one GPU of a `tp`-way engine: vLLM splits the KV heads
    over its GPUs and replicates them when there are fewer heads than GPUs (its KV cache is in the
    model dtype by default)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads = max(1, config.num_key_value_heads // tp)
    return 2 * config.num_hidden_layers * heads * head_dim * dtype_bytes


def engine_reserve(config, max_seqs: int, tp: int = 1) -> int:
    """vLLM's non-KV working memory per GPU: one forward of ENGINE_BATCHED_TOKENS (the residual stream
    and, split over the `tp` GPUs, q/k/v and the MLP's gate/up in bf16), the sampler's fp32 logits for
    max_seqs rows (two copies), plus CUDA graphs and non-torch allocations."""
    per_token = 2 * (2 * config.hidden_size + (2 * config.hidden_size + 3 * config.intermediate_size) // tp)
    logits = 2 * 4 * max_seqs * config.vocab_size
    return ENGINE_BATCHED_TOKENS * per_token + logits + int(ENGINE_GRAPHS_AND_NON_TORCH)


def engine_memory(config, parameters: int, gpu_memory: int, engine: dict[str, Any]) -> EngineMemory:
    """One GPU of an engine: gpu_memory_utilization of it, less 1/tp of the weights and the reserve,
    is KV cache; each trajectory of max_model_len tokens needs its 1/tp share of each token's KV."""
    tp = int(engine.get("tensor_parallel_size", 1))
    dtype_bytes = 4 if engine.get("dtype") == "float32" else 2
    budget = int(engine["gpu_memory_utilization"] * gpu_memory)
    weights = parameters * dtype_bytes // tp
    reserve = engine_reserve(config, int(engine.get("max_batch_size", 256)), tp)
    kv = max(0, budget - weights - reserve)
    per_token = kv_bytes_per_token(config, dtype_bytes, tp)
    length = int(engine["max_model_len"])
    return EngineMemory(budget, weights, reserve, kv, per_token, length, kv // (per_token * length))


# ---- the plan ----


def allocator_slack() -> float:
    """The allowance on the measured peak for what the CUDA caching allocator holds beyond the tensors.
    The trainer turns expandable segments on (tirl.distributed.groups.init_distributed) unless
    PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF is set: segments then grow in place and the waste
    stays small (5%); with fixed segments blocks of differing micro-batch shapes fragment the pool
    (15%, a conservative round number)."""
    conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if conf is None or "expandable_segments:true" in conf.lower().replace(" ", ""):
        return 0.05
    return 0.15


def make_plan(config, cluster: ClusterShape, workload: Workload, name: str = "", advise: bool = True) -> Plan:
    """Measure training, size the engines, judge each phase against the GPU's memory, and (`advise`)
    find the config overrides that make a plan that does not fit fit (re-measured: they converge)."""
    plan = plan_from(config, cluster, workload, name, measured(config, cluster.gpus, workload))
    if advise and not plan.fits:
        plan.fixes = fixes_for(config, plan)
    return plan


def plan_from(config, cluster: ClusterShape, workload: Workload, name: str, training: TrainingMemory) -> Plan:
    """The plan around a training measurement (measure_training's, or one taken on a GPU): the engine
    arithmetic, each phase's total per GPU, and what does not fit (no fixes: make_plan finds those)."""
    from tirl.distributed.weight_sync import plan_entries
    from tirl.engines.handoff import flat_layout

    model = _meta_model(config)
    parameters = sum(p.numel() for p in model.parameters())
    engine_dtype = torch.float32 if (workload.engine or {}).get("dtype") == "float32" else torch.bfloat16
    synced = None
    if workload.lora:  # the merged adapted layers (and their vLLM-fused siblings) only: tirl.rl.lora
        from tirl.rl.config import LoraConfig
        from tirl.rl.lora import apply_lora, merged_tensors

        synced = dict(merged_tensors(apply_lora(_meta_model(config), LoraConfig(**workload.lora))))
    sync_bytes = sum(e.nbytes for e in plan_entries(model, engine_dtype, synced))
    entries = (synced if synced is not None else dict(model.named_parameters())).items()
    _, buffer = flat_layout(((name, tuple(t.shape), t.dtype) for name, t in entries), engine_dtype)
    largest = _largest_made(model, synced, cluster.gpus)
    engine = (
        engine_memory(config, parameters, cluster.gpu_memory, workload.engine) if workload.engine else None
    )
    plan = Plan(
        name or getattr(config, "model_type", "model"),
        parameters,
        cluster,
        workload,
        training,
        engine,
        sync_bytes,
        0,
        None,
        slack=allocator_slack(),
        largest_tensor=largest,
    )
    if packs_whole(cluster, workload):
        tp = int(workload.engine.get("tensor_parallel_size", 1))
        plan.sync_buffer, plan.buffer_on_gpu = buffer, cluster.colocated
        plan.buffer_in_file = not cluster.colocated or cluster.gpus > tp
    plan.training_total = sum(v for _, v in plan._training_terms())
    if engine is not None:
        plan.rollout_total = sum(v for _, v in plan._rollout_terms())
        if cluster.colocated:
            plan.sync_total = sum(v for _, v in plan._sync_terms())
    plan.advice = _advice(config, plan)
    plan.fits = not plan.advice
    return plan


def _largest_made(model: torch.nn.Module, synced: dict | None, gpus: int) -> int:
    """The largest tensor a sync makes whole, in fp32, one at a time: each parameter gathered from its
    FSDP shards (on one GPU the single-process trainer's are whole already: none made), or with LoRA
    each merged layer (tirl.rl.lora.merged_tensors, on every shape)."""
    if synced is not None:
        return max(math.prod(t.shape) for t in synced.values()) * 4
    return 0 if gpus == 1 else max(p.numel() for p in model.parameters()) * 4


def packs_whole(cluster: ClusterShape, workload: Workload) -> bool:
    """Whether rank 0 packs each sync whole (tirl.runtime.base.load_sources): in-process vLLM engines,
    the only FlatLoader; Ray's group streams buckets, other engines take (name, tensor) pairs.
    Colocated, engine 0 is on rank 0's GPU (engine i on cuda:i*tp) and the buffer is there; the engines
    on other GPUs, or all of them when none shares it, read one /dev/shm file."""
    engine = workload.engine
    return cluster.transport == "load" and engine is not None and engine.get("backend", "vllm") == "vllm"


def _training_fits(plan: Plan) -> bool:
    return plan.training_total <= plan.cluster.gpu_memory


def _advice(config, plan: Plan) -> list[str]:
    """What does not fit, one item per phase, each naming the config keys that change it."""
    c, w = plan.cluster, plan.workload
    out = []
    if not _training_fits(plan):
        out.append(
            f"training needs {_gb(plan.training_total)} GiB per GPU of {_gb(c.gpu_memory)}: "
            + _training_options(plan)
        )
    engine = plan.engine
    if engine is None:
        return out
    low, high = _utilization_range(config, plan)
    u = float(w.engine["gpu_memory_utilization"])
    if low > high:
        out.append(
            f"no engine.gpu_memory_utilization gives an engine room for one trajectory of "
            f"{engine.trajectory_tokens} tokens (it needs >= {low:.2f}, the GPU leaves <= {high:.2f}): "
            + _engine_options(config, plan)
        )
    elif u > high:
        out.append(
            f"rollout needs {_gb(plan.rollout_total)} GiB per GPU: set engine.gpu_memory_utilization={high:.2f}"
        )
    elif u < low:
        out.append(
            f"an engine's KV cache ({_gb(engine.kv_cache)} GiB) holds no trajectory of {engine.trajectory_tokens} "
            f"tokens: set engine.gpu_memory_utilization={min(high, 0.9):.2f}"
        )
    if plan.sync_total is not None and plan.sync_total > c.gpu_memory:
        out.append(_sync_advice(plan))
    return out


def _sync_advice(plan: Plan) -> str:
    options = [
        "use more GPUs (smaller parameter shards)",
        "a larger engine.tensor_parallel_size (smaller engine weights per GPU)",
    ]
    held = "the woken engine's weights next to the trainer's parameters"
    if plan.buffer_on_gpu:
        held += f" and the sync packed whole, {_gb(plan.sync_buffer)} GiB"
        options.append("cluster.backend=ray (its sync group streams buckets)")
    where = "on rank 0's GPU" if plan.buffer_on_gpu else "per GPU"
    return f"the weight sync needs {_gb(plan.sync_total)} GiB {where} ({held}): " + ", or ".join(options)


def _training_options(plan: Plan) -> str:
    w = plan.workload
    b, n = w.micro_batch
    key = _length_key(w)
    options = []
    if b > 1:
        options.append(f"fewer tokens per micro-batch (optim.micro_batch_tokens, at least {key}={n})")
    if not w.gradient_checkpointing:
        options.append("optim.gradient_checkpointing=true")
    if not w.lora:
        options.append("optim.lora.enabled=true")
    options.append(
        f"more GPUs (torchrun --nproc_per_node, or cluster.trainer.ranks on Ray; the sharded state is "
        f"{_gb(plan.training.parameter_bytes + plan.training.by_category.get('OptState', 0))} GiB at {plan.cluster.gpus})"
    )
    options.append(f"a shorter {key} (`tirl plan --largest context` finds the longest that fits)")
    return ", or ".join(options)


def _length_key(w: Workload) -> str:
    return "engine.max_model_len" if w.engine is not None else "max_length"


def _utilization_range(config, plan: Plan, engine: dict | None = None) -> tuple[float, float]:
    """The engine.gpu_memory_utilization values that work, to 2 decimals: at least enough for one
    trajectory of max_model_len, at most what the rest of the GPU leaves while generating."""
    c = plan.cluster
    e = engine_memory(
        config,
        plan.parameters,
        c.gpu_memory,
        (engine or plan.workload.engine) | {"gpu_memory_utilization": 1.0},
    )
    need = e.weights + e.reserve + e.kv_per_token * e.trajectory_tokens
    low = math.ceil(100 * need / c.gpu_memory) / 100
    beside = (plan.rollout_total or 0) - plan.engine.budget  # the trainer's share while generating
    high = min(1.0, math.floor(100 * (c.gpu_memory - beside) / c.gpu_memory) / 100)
    return low, high


def _engine_options(config, plan: Plan) -> str:
    options = []
    tp = _tensor_parallel_fix(config, plan)
    if tp is not None:
        options.append(f"set engine.tensor_parallel_size={tp}")
    length = _max_model_len_fix(config, plan)
    if length is not None:
        options.append(f"set engine.max_model_len={length}")
    return ", or ".join(options) or "use GPUs with more memory"


def _tensor_parallel_fix(config, plan: Plan) -> int | None:
    """The smallest tensor-parallel size (a divisor of the attention heads, up to 8) with room."""
    engine = plan.workload.engine
    for tp in (2, 4, 8):
        if tp <= int(engine.get("tensor_parallel_size", 1)) or config.num_attention_heads % tp:
            continue
        low, high = _utilization_range(config, plan, engine | {"tensor_parallel_size": tp})
        if low <= high:
            return tp
    return None


def _max_model_len_fix(config, plan: Plan) -> int | None:
    """The longest max_model_len (a multiple of 1024) with room for one trajectory."""
    engine = plan.workload.engine
    length = (int(engine["max_model_len"]) - 1) // 1024 * 1024
    while length >= 1024:
        low, high = _utilization_range(config, plan, engine | {"max_model_len": length})
        if low <= high:
            return length
        length -= 1024
    return None


# ---- fixes: overrides that make it fit, each checked by planning again ----


def fixes_for(config, plan: Plan) -> dict[str, str]:
    """Config overrides that make `plan` fit, checked by planning again with them (so applying them
    converges): the engine's from its arithmetic, then training's by measuring (fewer sequences per
    micro-batch; then, at one sequence, gradient checkpointing, then LoRA). Empty when none is found."""
    w = plan.workload
    engine_fix = _engine_fix(config, plan) if w.engine is not None else {}
    if engine_fix is None:
        return {}
    fixes = {f"engine.{k}": str(v) for k, v in engine_fix.items()}
    workload, training = w, plan.training
    if engine_fix:
        engine = w.engine | engine_fix
        length = int(engine["max_model_len"])
        workload = replace(w, engine=engine, micro_batch=micro_batch_shape(_tokens(w), length))
        if workload.micro_batch != w.micro_batch:
            training = measured(config, plan.cluster.gpus, workload)
    final = plan_from(config, plan.cluster, workload, plan.architecture, training)
    if not _training_fits(final):
        found = _training_fix(config, final)
        if found is None:
            return {}
        final, training_fixes = found
        fixes |= training_fixes
    return fixes if final.fits else {}


def _tokens(w: Workload) -> int:
    return w.micro_batch[0] * w.micro_batch[1]


def _engine_fix(config, plan: Plan) -> dict[str, Any] | None:
    """The engine settings that make its phases fit: one gpu_memory_utilization inside the range that
    works, else a tensor-parallel size or a shorter max_model_len with room (None: nothing works)."""
    engine = plan.workload.engine
    low, high = _utilization_range(config, plan)
    u = float(engine["gpu_memory_utilization"])
    if low <= high:
        return (
            {}
            if low <= u <= high
            else {"gpu_memory_utilization": high if u > high else min(high, max(low, 0.9))}
        )
    for key, value in (
        ("tensor_parallel_size", _tensor_parallel_fix(config, plan)),
        ("max_model_len", _max_model_len_fix(config, plan)),
    ):
        if value is not None:
            low, high = _utilization_range(config, plan, engine | {key: value})
            return {key: value} | (
                {} if low <= u <= high else {"gpu_memory_utilization": high if u > high else low}
            )
    return None


def _training_fix(config, plan: Plan) -> tuple[Plan, dict[str, str]] | None:
    """A training setting that fits, measured: the most sequences per micro-batch that fit; else
    gradient checkpointing and then LoRA (rank 16, all linear layers) on, at the configured micro-batch
    when it fits so, at one sequence otherwise."""
    w = plan.workload
    b, n = w.micro_batch
    one = plan if b == 1 else _plan_with(config, plan, replace(w, micro_batch=(1, n)))
    if _training_fits(one):
        best = _most_sequences(config, plan, one)
        return best, {"optim.micro_batch_tokens": str(_tokens(best.workload))}
    changes: dict[str, Any] = {}
    fixes: dict[str, str] = {}
    for key, change in (
        ("optim.gradient_checkpointing", {"gradient_checkpointing": True}),
        ("optim.lora.enabled", {"lora": default_lora()}),
    ):
        if getattr(w, next(iter(change))):
            continue
        changes |= change
        fixes[key] = "true"
        one = _plan_with(config, one, replace(one.workload, **changes))
        if _training_fits(one):
            full = _plan_with(config, plan, replace(w, **changes)) if b > 1 else one
            if _training_fits(full):
                return full, fixes
            return one, fixes | {"optim.micro_batch_tokens": str(n)}
    return None


def default_lora() -> dict[str, Any]:
    """optim.lora as `optim.lora.enabled=true` alone sets it."""
    from tirl.rl.config import LoraConfig

    return LoraConfig(enabled=True).model_dump()


def _plan_with(config, plan: Plan, workload: Workload) -> Plan:
    return plan_from(
        config,
        plan.cluster,
        workload,
        plan.architecture,
        measured(config, plan.cluster.gpus, workload),
    )


def _most_sequences(config, full: Plan, one: Plan) -> Plan:
    """The largest micro-batch below `full`'s that fits, given `one` (one sequence) fits: the peak grows
    about linearly with the sequences, so the measurements around the answer predict it; each guess is
    measured and narrows the bracket (fits at `best`, does not at `above`) until they are neighbours."""
    n = full.workload.micro_batch[1]
    fixed = one.training_total - one.training.peak * (1 + one.slack)
    limit = (full.cluster.gpu_memory - fixed) / (1 + one.slack)
    best, above = one, full
    while above.workload.micro_batch[0] - best.workload.micro_batch[0] > 1:
        low, high = best.workload.micro_batch[0], above.workload.micro_batch[0]
        slope = (above.training.peak - best.training.peak) / (high - low)
        guess = low + int((limit - best.training.peak) // max(1.0, slope))
        guess = min(high - 1, max(low + 1, guess))
        candidate = _plan_with(config, one, replace(one.workload, micro_batch=(guess, n)))
        if _training_fits(candidate):
            best = candidate
        else:
            above = candidate
    return best


# ---- the largest setting that fits ----

LARGEST = ("micro-batch", "context", "model")


def largest(
    config, cluster: ClusterShape, workload: Workload, what: str, name: str = ""
) -> tuple[str, Any, Plan]:
    """The largest micro-batch (optim.micro_batch_tokens), context (engine.max_model_len, or max_length
    for SFT) or model (of the Qwen3 family) whose whole plan fits: (config key, value, its plan), or
    (key, None, the smallest candidate's plan) when none fits. Each candidate is measured: a few plans'
    time."""
    if what == "micro-batch":
        return _largest_micro_batch(config, cluster, workload, name)
    if what == "context":
        return _largest_context(config, cluster, workload, name)
    if what == "model":
        return _largest_model(cluster, workload)
    raise ValueError(f"--largest {what}: expected one of {', '.join(LARGEST)}")


def _largest_micro_batch(config, cluster, workload, name) -> tuple[str, Any, Plan]:
    n = workload.micro_batch[1]
    one = make_plan(config, cluster, replace(workload, micro_batch=(1, n)), name, advise=False)
    if not one.fits:
        return "optim.micro_batch_tokens", None, one
    two = make_plan(config, cluster, replace(workload, micro_batch=(2, n)), name, advise=False)
    if not two.fits:
        return "optim.micro_batch_tokens", n, one
    # between two sequences (fit) and 256 (taken not to: its peak extrapolated from one and two)
    far = replace(two, workload=replace(two.workload, micro_batch=(256, n)))
    far.training = replace(
        two.training, peak=two.training.peak + 254 * (two.training.peak - one.training.peak)
    )
    best = _most_sequences(config, far, two)
    return "optim.micro_batch_tokens", _tokens(best.workload), best


def _largest_context(config, cluster, workload, name) -> tuple[str, Any, Plan]:
    """Binary search over multiples of 1024 up to the model's max_position_embeddings; the micro-batch
    keeps its token budget (at least one sequence)."""
    budget = _tokens(workload)

    def plan_at(length: int) -> Plan:
        engine = workload.engine | {"max_model_len": length} if workload.engine else None
        shape = micro_batch_shape(budget, length)
        return make_plan(
            config, cluster, replace(workload, engine=engine, micro_batch=shape), name, advise=False
        )

    best = plan_at(1024)
    if not best.fits:
        return _length_key(workload), None, best
    low, high = 1, getattr(config, "max_position_embeddings", 32768) // 1024
    while low < high:
        mid = (low + high + 1) // 2
        candidate = plan_at(mid * 1024)
        if candidate.fits:
            low, best = mid, candidate
        else:
            high = mid - 1
    return _length_key(workload), low * 1024, best


def _largest_model(cluster, workload) -> tuple[str, Any, Plan]:
    """Down the Qwen3 family from the largest, the first whose plan fits."""
    for arch in sorted(QWEN3, key=lambda a: -parameter_count(architecture_config(a))):
        plan = make_plan(architecture_config(arch), cluster, workload, arch, advise=False)
        if plan.fits:
            return "model", arch, plan
    return "model", None, plan


def largest_for_config(cfg, cluster: ClusterShape, what: str, arch: str | None = None) -> tuple[str, Plan]:
    """`tirl plan --largest WHAT`: one line with the answer, and the plan of that setting (of the
    smallest candidate when nothing fits)."""
    spec = arch or cfg.model
    key, value, plan = largest(architecture_config(spec), cluster, workload_of(cfg), what, spec)
    if value is None:
        return f"nothing fits: not even the smallest {key} (its plan below)", plan
    return f"largest {key} that fits: {value}", plan


# ---- from a tirl config ----


def micro_batch_shape(budget: int, longest: int) -> tuple[int, int]:
    """The worst micro-batch the packer (tirl.rl.policy.pack_micro_batches) can form: sequences of the
    longest length, as many as the token budget allows (one if a sequence exceeds the budget)."""
    return max(1, budget // longest), longest


def workload_of(cfg) -> Workload:
    """The workload of a TrainConfig (RL) or SFTConfig."""
    from tirl.devices import resolve_dtype

    optim = cfg.optim
    bf16 = resolve_dtype(optim.dtype, torch.device("cuda")) == torch.bfloat16
    lora = optim.lora.model_dump() if optim.lora.enabled else None
    engine = getattr(cfg, "engine", None)
    if engine is None:  # SFT: examples up to max_length tokens, no engines
        shape = micro_batch_shape(optim.micro_batch_tokens, cfg.max_length)
        return Workload(shape, bf16, optim.gradient_checkpointing, lora=lora)
    shape = micro_batch_shape(optim.micro_batch_tokens, engine.max_model_len)
    fields = (
        "max_model_len",
        "gpu_memory_utilization",
        "tensor_parallel_size",
        "dtype",
        "max_batch_size",
        "backend",
    )
    engine_fields = {k: getattr(engine, k) for k in fields}
    return Workload(shape, bf16, optim.gradient_checkpointing, engine_fields, lora=lora)


def colocated_by_config(cfg) -> bool:
    """Engines share the trainer's GPUs: backend=local always does (engine i on cuda:i), Ray when
    cluster.colocate is set. SFT has no engines."""
    cluster = getattr(cfg, "cluster", None)
    return cluster is not None and (cluster.backend == "local" or cluster.colocate)


def cluster_of(
    cfg, gpus: int, gpu_memory: int, colocated: bool | None = None, trainer_offload: bool | None = None
) -> ClusterShape:
    """The cluster shape of a config on `gpus` GPUs of `gpu_memory` bytes: colocated as the config says
    unless told, and the trainer offloaded during rollouts when colocated and synchronous, as
    tirl.rl.trainer does (async runs cannot colocate)."""
    shared = colocated_by_config(cfg) if colocated is None else colocated
    if trainer_offload is None:
        algorithm = getattr(cfg, "algorithm", None)
        trainer_offload = shared and not (algorithm is not None and algorithm.async_)
    cluster = getattr(cfg, "cluster", None)
    transport = "group" if cluster is not None and cluster.backend == "ray" else "load"
    return ClusterShape(gpus, gpu_memory, shared, trainer_offload, transport)


def plan_for_config(cfg, cluster: ClusterShape, arch: str | None = None) -> Plan:
    spec = arch or cfg.model
    return make_plan(architecture_config(spec), cluster, workload_of(cfg), spec)


# ---- the preflight of `tirl train` / `tirl sft` on a GPU ----


def preflight_cluster(cfg) -> ClusterShape | None:
    """The cluster this process is about to train on, or None without CUDA (nothing to check): Ray's
    trainer ranks or torchrun's WORLD_SIZE, each GPU as large as this process's first one."""
    if not torch.cuda.is_available():
        return None
    cluster = getattr(cfg, "cluster", None)
    ranks = cluster.trainer.ranks if cluster is not None and cluster.backend == "ray" else None
    world = ranks or int(os.environ.get("WORLD_SIZE", "1"))
    memory = torch.cuda.get_device_properties(0).total_memory
    return cluster_of(cfg, world, memory)


def preflight_command(
    cfg, cluster: ClusterShape, config_path: str, overrides: list[str], kind: str
) -> list[str]:
    """The `tirl plan` command line the preflight runs for `cluster`."""
    cmd = [sys.executable, "-m", "tirl.cli", "plan", "--kind", kind, "--config", config_path]
    cmd += ["--gpus", str(cluster.gpus), "--gpu-memory", f"{cluster.gpu_memory / GiB:.3f}"]
    cmd += ["--colocate" if cluster.colocated else "--separate"]
    cmd += ["--trainer-offload" if cluster.trainer_offload else "--no-trainer-offload"]
    return [*cmd, *overrides]


def memory_preflight(cfg, config_path: str, overrides: list[str], kind: str) -> list[str]:
    """On a CUDA machine, run `tirl plan` for this config in a subprocess (a fake process group must
    not meet the real one) and stop before any GPU work when it does not fit. TIRL_SKIP_PLAN=1 skips."""
    from tirl.config import ConfigError

    cluster = preflight_cluster(cfg)
    if cluster is None or os.environ.get("TIRL_SKIP_PLAN") == "1":
        return []
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    cmd = preflight_command(cfg, cluster, config_path, overrides, kind)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    verdict = next((line for line in reversed(lines) if line.startswith(("FITS", "DOES NOT FIT"))), None)
    verdict = verdict or (lines or [proc.stderr.strip()[-500:]])[-1]
    if proc.returncode == 1:  # measured and does not fit
        raise ConfigError(f"memory plan: {verdict} (TIRL_SKIP_PLAN=1 skips this check)")
    if proc.returncode != 0:
        return [f"warning: the memory plan could not run: {verdict}"]
    return [f"memory plan: {verdict}"]
