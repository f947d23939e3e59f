"""`tirl plan`: will a config fit its GPUs? Measured, not guessed, and without a GPU or any weights.

The plan itself: its inputs (the cluster shape, the workload, the architecture), each phase's memory per
GPU, the verdict, and the config -> plan glue. Training memory is a measurement it is given
(tirl.rl.memory_probe: one update on the real architecture under fake tensors and a fake process group);
tirl.rl.planner takes it, makes the plan, and searches for the overrides that make it fit.

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
from dataclasses import asdict, dataclass, field
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
    # How a sync reaches the engines (tirl.runtime.handoff.pick_transport): "load", in-process engines
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


# The steady state of an update: the trainer accumulates gradients over the step's micro-batches
# (tirl.rl.policy.Policy.accumulate), so from the second one on its backward runs with the first one's
# gradients held; two micro-batches measure exactly that (tirl.rl.memory_probe runs them, the plan says so).
MICRO_BATCHES = 2


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
    model = meta_model(config)
    return sum(p.numel() for p in model.parameters())


def meta_model(config) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


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


def plan_from(config, cluster: ClusterShape, workload: Workload, name: str, training: TrainingMemory) -> Plan:
    """The plan around a training measurement (measure_training's, or one taken on a GPU): the engine
    arithmetic, each phase's total per GPU, and what does not fit (no fixes: make_plan finds those)."""
    from tirl.distributed.weight_sync import plan_entries
    from tirl.engines.handoff import flat_layout

    model = meta_model(config)
    parameters = sum(p.numel() for p in model.parameters())
    engine_dtype = torch.float32 if (workload.engine or {}).get("dtype") == "float32" else torch.bfloat16
    synced = None
    if workload.lora:  # the merged adapted layers (and their vLLM-fused siblings) only: tirl.rl.lora
        from tirl.rl.config import LoraConfig
        from tirl.rl.lora import apply_lora, merged_tensors

        synced = dict(merged_tensors(apply_lora(meta_model(config), LoraConfig(**workload.lora))))
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


# ---- the verdict: what does not fit, each naming the config keys that change it ----


def training_fits(plan: Plan) -> bool:
    return plan.training_total <= plan.cluster.gpu_memory


def _advice(config, plan: Plan) -> list[str]:
    """What does not fit, one item per phase, each naming the config keys that change it."""
    c, w = plan.cluster, plan.workload
    out = []
    if not training_fits(plan):
        out.append(
            f"training needs {_gb(plan.training_total)} GiB per GPU of {_gb(c.gpu_memory)}: "
            + _training_options(plan)
        )
    engine = plan.engine
    if engine is None:
        return out
    low, high = utilization_range(config, plan)
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
            f"tokens: set engine.gpu_memory_utilization={raised_utilization(low, high):.2f}"
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
    key = length_key(w)
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


def length_key(w: Workload) -> str:
    return "engine.max_model_len" if w.engine is not None else "max_length"


def utilization_range(config, plan: Plan, engine: dict | None = None) -> tuple[float, float]:
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


def raised_utilization(low: float, high: float) -> float:
    """The utilization advised for a KV cache too small: 0.9 (vLLM's default), kept inside the range
    that works, so the advice and the planner's fix agree."""
    return min(high, max(low, 0.9))


def _engine_options(config, plan: Plan) -> str:
    options = []
    tp = tensor_parallel_fix(config, plan)
    if tp is not None:
        options.append(f"set engine.tensor_parallel_size={tp}")
    length = max_model_len_fix(config, plan)
    if length is not None:
        options.append(f"set engine.max_model_len={length}")
    return ", or ".join(options) or "use GPUs with more memory"


def tensor_parallel_fix(config, plan: Plan) -> int | None:
    """The smallest tensor-parallel size (a divisor of the attention heads, up to 8) with room."""
    engine = plan.workload.engine
    for tp in (2, 4, 8):
        if tp <= int(engine.get("tensor_parallel_size", 1)) or config.num_attention_heads % tp:
            continue
        low, high = utilization_range(config, plan, engine | {"tensor_parallel_size": tp})
        if low <= high:
            return tp
    return None


def max_model_len_fix(config, plan: Plan) -> int | None:
    """The longest max_model_len (a multiple of 1024) with room for one trajectory."""
    engine = plan.workload.engine
    length = (int(engine["max_model_len"]) - 1) // 1024 * 1024
    while length >= 1024:
        low, high = utilization_range(config, plan, engine | {"max_model_len": length})
        if low <= high:
            return length
        length -= 1024
    return None


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


def preflight_command(cluster: ClusterShape, config_path: str, overrides: list[str], kind: str) -> list[str]:
    """The `tirl plan` command line the preflight runs for `cluster`."""
    cmd = [sys.executable, "-m", "tirl.cli", "plan", "--kind", kind, "--config", config_path]
    cmd += ["--gpus", str(cluster.gpus), "--gpu-memory", f"{cluster.gpu_memory / GiB:.3f}"]
    cmd += ["--colocate" if cluster.colocated else "--separate"]
    cmd += ["--trainer-offload" if cluster.trainer_offload else "--no-trainer-offload"]
    return [*cmd, *overrides]


def preflight_env() -> dict[str, str]:
    """The preflight's `tirl plan` child's environment: this process's, less a torchrun rank's own
    variables (the plan's fake process group must never meet the run's)."""
    rank = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in rank}


def plan_verdict(proc: subprocess.CompletedProcess) -> str:
    """What a `tirl plan` run concluded: its last FITS / DOES NOT FIT line, else its last line of
    output, else the tail of its stderr (it crashed before printing anything)."""
    lines = proc.stdout.strip().splitlines()
    verdict = next((line for line in reversed(lines) if line.startswith(("FITS", "DOES NOT FIT"))), None)
    return verdict or (lines or [proc.stderr.strip()[-500:]])[-1]


def memory_preflight(cfg, config_path: str, overrides: list[str], kind: str) -> list[str]:
    """On a CUDA machine, run `tirl plan` for this config in a subprocess (a fake process group must
    not meet the real one) and stop before any GPU work when it does not fit. TIRL_SKIP_PLAN=1 skips."""
    from tirl.config import ConfigError

    cluster = preflight_cluster(cfg)
    if cluster is None or os.environ.get("TIRL_SKIP_PLAN") == "1":
        return []
    cmd = preflight_command(cluster, config_path, overrides, kind)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=preflight_env())
    verdict = plan_verdict(proc)
    if proc.returncode == 1:  # measured and does not fit
        raise ConfigError(f"memory plan: {verdict} (TIRL_SKIP_PLAN=1 skips this check)")
    if proc.returncode != 0:
        return [f"warning: the memory plan could not run: {verdict}"]
    return [f"memory plan: {verdict}"]
