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
            its context + the awake engine's whole budget.
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
QWEN3_14B: dict[str, Any] = dict(
    hidden_size=5120,
    num_hidden_layers=40,
    num_attention_heads=40,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=17408,
    vocab_size=151936,
    tie_word_embeddings=False,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen3-14b": QWEN3_14B,
    "Qwen/Qwen3-14B": QWEN3_14B,
    "Qwen/Qwen3-14B-Base": QWEN3_14B,
}


@dataclass(frozen=True)
class ClusterShape:
    gpus: int  # training ranks (FSDP world size); colocated, also the number of engines
    gpu_memory: int  # bytes per GPU
    colocated: bool = True
    trainer_offload: bool = False  # the trainer moves its state to host memory while engines generate


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
    peak: int  # bytes, as FSDP's memory tracker measured it on rank 0
    by_category: dict[str, int]
    resident: int  # between steps: sharded fp32 params + AdamW moments (gradients are set to None)
    trainable: int = 0  # parameters the optimizer updates (all of them; with LoRA the adapters only)


@dataclass
class EngineMemory:
    budget: int  # gpu_memory_utilization x GPU memory (x tensor-parallel GPUs)
    weights: int
    reserve: int
    kv_cache: int
    kv_per_token: int
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
    fits: bool = False
    advice: list[str] = field(default_factory=list)

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
        offload = ", trainer offloaded during rollouts" if c.trainer_offload else ""
        return f"{'colocated' if c.colocated else 'separate'} engines{offload}"

    def lines(self) -> list[str]:
        c, t = self.cluster, self.training
        b, n = self.workload.micro_batch
        out = [
            f"model: {self.architecture}, {self.parameters / 1e9:.2f}B parameters",
            f"cluster: {c.gpus} GPUs x {_gb(c.gpu_memory)} GiB, {self._layout()}",
            f"training (measured, one micro-batch of {b} x {n} tokens): peak {_gb(t.peak)} GiB per GPU ("
            + ", ".join(f"{k} {_gb(v)}" for k, v in t.by_category.items() if v >= GiB / 100)
            + ")",
            *(
                [
                    f"LoRA: rank {self.workload.lora['rank']}, {t.trainable / 1e6:.2f}M trainable parameters "
                    f"({100 * t.trainable / max(self.parameters, 1):.2f}%); gradients and AdamW state for "
                    "them only, the frozen base in the compute dtype"
                ]
                if self.workload.lora
                else []
            ),
            f"  + allocator slack, CUDA/NCCL context{', sleeping engine' if c.colocated and self.engine else ''}"
            f" = {_gb(self.training_total)} GiB; resident between steps {_gb(t.resident)} GiB",
        ]
        if self.engine is not None:
            e = self.engine
            out += [
                f"engine: budget {_gb(e.budget)} GiB = weights {_gb(e.weights)} + reserve {_gb(e.reserve)} "
                f"+ KV cache {_gb(e.kv_cache)} GiB ({e.kv_per_token // 1024} KiB per token)",
                f"  {e.trajectories} trajectories of {e.trajectory_tokens} tokens at once per engine "
                f"({e.kv_cache // max(e.kv_per_token, 1)} tokens)",
                f"rollout: {_gb(self.rollout_total or 0)} GiB per GPU",
                f"weight sync: {_gb(self.sync_bytes)} GiB per sync",
            ]
        return [*out, self.verdict()]


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


def _workload_meta_model(config, workload: Workload) -> torch.nn.Module:
    """The model on meta, with the workload's LoRA adapters injected as the trainer does it
    (tirl.rl.policy.with_lora). Outside FakeTensorMode: peft moves each adapter to its layer's device,
    which fake tensors refuse."""
    model = _meta_model(config)
    if workload.lora:
        from tirl.rl.config import LoraConfig
        from tirl.rl.policy import with_lora

        with_lora(model, LoraConfig(**workload.lora), workload.bf16)
    return model


def _fake_model(config, meta: torch.nn.Module | None = None) -> torch.nn.Module:
    """The model with storage-less fp32 parameters on CPU (call under FakeTensorMode). Built on meta
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


def measure_training(config, world: int, workload: Workload) -> TrainingMemory:
    """Peak memory of one training micro-batch on rank 0 of `world` FSDP2 ranks (no GPU, no weights).

    Runs in this process with a fake process group, which must not already have one (the `tirl train`
    preflight runs it in a subprocess)."""
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
        meta = _workload_meta_model(config, workload)
        with FakeTensorMode():
            return _measure_step(config, mesh, workload, meta)
    finally:
        dist.destroy_process_group()


def _measure_step(config, mesh, workload: Workload, meta: torch.nn.Module | None = None) -> TrainingMemory:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from tirl.distributed.groups import DistInfo, clip_grad_norm, shard_model
    from tirl.rl.policy import enable_gradient_checkpointing, install_token_head, token_logprobs

    model = _fake_model(config, meta)
    model.config.use_cache = False
    if workload.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    install_token_head(model)
    world = mesh.size()
    info = DistInfo(0, world, torch.device("cpu"))
    shard_model(model, info, workload.bf16, mesh=mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-6)
    _allocate_adam_state(optimizer)
    # between steps: every parameter's shard, and AdamW's two moments of the trained ones
    resident = sum(_local_bytes(p) for p in model.parameters()) + sum(_local_bytes(p) * 2 for p in trainable)
    batch, tokens = workload.micro_batch
    ids = torch.zeros((batch, tokens), dtype=torch.long)
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((ids,))
    with tracker:
        # No padding mask: every token is real (the worst case), and attention takes the fused causal
        # kernel with O(tokens) memory, as flash/memory-efficient attention does on the GPU. (A mask
        # whose values fake tensors cannot see would send it to the O(tokens^2) reference kernel.)
        logprobs, _ = token_logprobs(model, ids, None)
        (logprobs.sum() * world).backward()
        clip_grad_norm(trainable, 1.0, info)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = tracker.get_tracker_snapshot("peak")
    stats = next(iter(peak.values())) if peak else {}
    by_category = {getattr(k, "value", str(k)): int(v) for k, v in stats.items() if k != "Total"}
    count = sum(p.numel() for p in trainable)  # a DTensor counts its whole tensor
    return TrainingMemory(int(stats.get("Total", 0)), by_category, resident, count)


def _local_bytes(p: torch.Tensor) -> int:
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.numel() * local.element_size()


# ---- inference: vLLM's memory budget ----


def kv_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """K and V for every layer and KV head (vLLM's KV cache is in the model dtype by default)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype_bytes


def engine_reserve(config, max_seqs: int) -> int:
    """vLLM's non-KV working memory: one forward of ENGINE_BATCHED_TOKENS (the residual stream, q/k/v,
    and the MLP's gate/up in bf16), the sampler's fp32 logits for max_seqs rows (two copies), plus CUDA
    graphs and non-torch allocations."""
    per_token = 2 * (4 * config.hidden_size + 3 * config.intermediate_size)
    logits = 2 * 4 * max_seqs * config.vocab_size
    return ENGINE_BATCHED_TOKENS * per_token + logits + int(ENGINE_GRAPHS_AND_NON_TORCH)


def engine_memory(config, parameters: int, gpu_memory: int, engine: dict[str, Any]) -> EngineMemory:
    tp = int(engine.get("tensor_parallel_size", 1))
    dtype_bytes = 4 if engine.get("dtype") == "float32" else 2
    budget = int(engine["gpu_memory_utilization"] * gpu_memory)
    weights = parameters * dtype_bytes // tp
    reserve = engine_reserve(config, int(engine.get("max_batch_size", 256)))
    kv = max(0, budget - weights - reserve)
    per_token = kv_bytes_per_token(config, dtype_bytes) // tp
    length = int(engine["max_model_len"])
    return EngineMemory(budget, weights, reserve, kv, per_token, length, kv // (per_token * length))


# ---- the plan ----


def make_plan(config, cluster: ClusterShape, workload: Workload, name: str = "") -> Plan:
    """Measure training, size the engines, and judge both phases against the GPU's memory."""
    from tirl.distributed.weight_sync import plan_entries

    model = _meta_model(config)
    parameters = sum(p.numel() for p in model.parameters())
    engine_dtype = torch.float32 if (workload.engine or {}).get("dtype") == "float32" else torch.bfloat16
    synced = None
    if workload.lora:  # the merged adapted layers (and their vLLM-fused siblings) only: tirl.rl.lora
        from tirl.rl.config import LoraConfig
        from tirl.rl.lora import apply_lora, merged_tensors

        synced = dict(merged_tensors(apply_lora(_meta_model(config), LoraConfig(**workload.lora))))
    sync_bytes = sum(e.nbytes for e in plan_entries(model, engine_dtype, synced))
    training = measure_training(config, cluster.gpus, workload)
    engine = (
        engine_memory(config, parameters, cluster.gpu_memory, workload.engine) if workload.engine else None
    )
    colocated = cluster.colocated and engine is not None
    training_total = int(training.peak * (1 + ALLOCATOR_SLACK) + TRAINER_CONTEXT)
    training_total += int(ENGINE_ASLEEP) if colocated else 0
    rollout_total = None
    if engine is not None:
        resident = 0 if cluster.trainer_offload else training.resident
        rollout_total = engine.budget + (int(resident + TRAINER_CONTEXT) if colocated else 0)
    plan = Plan(
        name or getattr(config, "model_type", "model"),
        parameters,
        cluster,
        workload,
        training,
        engine,
        sync_bytes,
        training_total,
        rollout_total,
    )
    plan.advice = _advice(plan)
    plan.fits = not plan.advice
    return plan


def _advice(plan: Plan) -> list[str]:
    """What to change, one item per phase that does not fit (empty when everything fits)."""
    c, w, t = plan.cluster, plan.workload, plan.training
    out = []
    if plan.training_total > c.gpu_memory:
        batch, tokens = w.micro_batch
        # Activations grow with the micro-batch; the sharded state and gathered layers do not.
        fixed = t.by_category.get("Sharded Param", 0) + t.by_category.get("OptState", 0)
        spare = (
            c.gpu_memory
            - (plan.training_total - t.peak * (1 + ALLOCATOR_SLACK))
            - fixed * (1 + ALLOCATOR_SLACK)
        )
        scale = spare / max(1.0, (t.peak - fixed) * (1 + ALLOCATOR_SLACK))
        hint = f"optim.micro_batch_tokens <= {int(batch * tokens * scale) // 1024 * 1024}"
        if not w.gradient_checkpointing:
            hint = "optim.gradient_checkpointing=true, or " + hint
        out.append(
            f"training needs {_gb(plan.training_total)} GiB per GPU: set {hint}, or use more GPUs "
            f"(the sharded state is {_gb(fixed)} GiB at {c.gpus})"
        )
    if plan.rollout_total is not None and plan.rollout_total > c.gpu_memory:
        room = c.gpu_memory - (plan.rollout_total - plan.engine.budget)
        out.append(
            f"rollout needs {_gb(plan.rollout_total)} GiB per GPU: set engine.gpu_memory_utilization <= "
            f"{math.floor(100 * room / c.gpu_memory) / 100:.2f} or offload the trainer during rollouts"
        )
    if plan.engine is not None and plan.engine.trajectories < 1:
        out.append(
            f"an engine's KV cache ({_gb(plan.engine.kv_cache)} GiB) holds no trajectory of "
            f"{plan.engine.trajectory_tokens} tokens: raise engine.gpu_memory_utilization or "
            "engine.tensor_parallel_size, or lower engine.max_model_len"
        )
    return out


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
    fields = ("max_model_len", "gpu_memory_utilization", "tensor_parallel_size", "dtype", "max_batch_size")
    engine_fields = {k: getattr(engine, k) for k in fields}
    return Workload(shape, bf16, optim.gradient_checkpointing, engine_fields, lora=lora)


def colocated_by_config(cfg) -> bool:
    """Engines share the trainer's GPUs: backend=local always does (engine i on cuda:i), Ray when
    cluster.colocate is set. SFT has no engines."""
    cluster = getattr(cfg, "cluster", None)
    return cluster is not None and (cluster.backend == "local" or cluster.colocate)


def plan_for_config(cfg, cluster: ClusterShape, arch: str | None = None) -> Plan:
    spec = arch or cfg.model
    return make_plan(architecture_config(spec), cluster, workload_of(cfg), spec)


# ---- the preflight of `tirl train` / `tirl sft` on a GPU ----


def preflight_cluster(cfg) -> ClusterShape | None:
    """The cluster this process is about to train on, or None without CUDA (nothing to check)."""
    if not torch.cuda.is_available():
        return None
    cluster = getattr(cfg, "cluster", None)
    ranks = cluster.trainer.ranks if cluster is not None and cluster.backend == "ray" else None
    world = ranks or int(os.environ.get("WORLD_SIZE", "1"))
    memory = torch.cuda.get_device_properties(0).total_memory
    return ClusterShape(world, memory, colocated_by_config(cfg))


def memory_preflight(cfg, config_path: str, overrides: list[str], kind: str) -> list[str]:
    """On a CUDA machine, run `tirl plan` for this config in a subprocess (a fake process group must
    not meet the real one) and stop before any GPU work when it does not fit. TIRL_SKIP_PLAN=1 skips."""
    from tirl.config import ConfigError

    cluster = preflight_cluster(cfg)
    if cluster is None or os.environ.get("TIRL_SKIP_PLAN") == "1":
        return []
    cmd = [sys.executable, "-m", "tirl.cli", "plan", "--kind", kind, "--config", config_path]
    cmd += ["--gpus", str(cluster.gpus), "--gpu-memory", f"{cluster.gpu_memory / GiB:.3f}"]
    cmd += ["--colocate" if cluster.colocated else "--separate", *overrides]
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    verdict = (proc.stdout.strip().splitlines() or [proc.stderr.strip()[-500:]])[-1]
    if proc.returncode == 1:  # measured and does not fit
        raise ConfigError(f"memory plan: {verdict} (TIRL_SKIP_PLAN=1 skips this check)")
    if proc.returncode != 0:
        return [f"warning: the memory plan could not run: {verdict}"]
    return [f"memory plan: {verdict}"]
