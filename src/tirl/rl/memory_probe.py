"""Measure one training update's peak memory without allocating it: no GPU, no weights.

The model is built from its config under FakeTensorMode (tensors with shapes and dtypes but no storage),
sharded with FSDP2 over a fake process group of the real world size (rank 0's shard sizes are exact),
and MICRO_BATCHES micro-batches of the configured token budget run forward, backward and the AdamW step
through the same code the trainer runs (the chunked head, gradient checkpointing, the bf16
mixed-precision policy) under torch's memory tracker, with the optimizer state already allocated (the
steady state of step 2 onwards). The plan (tirl.rl.plan) adds what the tracker cannot see.
"""

from __future__ import annotations

import warnings

import torch

from tirl.rl.plan import MICRO_BATCHES, TrainingMemory, Workload

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


def _fake_model(model: torch.nn.Module) -> torch.nn.Module:
    """The meta model with storage-less parameters on CPU (call under FakeTensorMode): built on meta
    and then given fake parameters, which skips the random initialization (seconds at 14B)."""
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
            return _measure_one_process(workload, meta)
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise RuntimeError(
            "measure_training needs a process without a process group (run it in a subprocess)"
        )
    dist.init_process_group("fake", rank=0, world_size=world)  # the fake backend needs no store
    try:
        mesh = init_device_mesh("cpu", (world,))  # outside fake mode: the mesh is real bookkeeping
        with FakeTensorMode(), warnings.catch_warnings():
            # The token head's (log-prob, entropy) outputs are views; FSDP2 warns that an in-place op
            # on one would skip its hook. Nothing modifies them in place (the trainer neither).
            warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor")
            return _measure_sharded(mesh, workload, meta)
    finally:
        dist.destroy_process_group()


def _prepared(workload: Workload, meta: torch.nn.Module) -> torch.nn.Module:
    """The fake model as tirl.rl.policy._prepare leaves it (checkpointing, no KV cache, the token head)."""
    from tirl.rl.policy import enable_gradient_checkpointing, install_token_head

    model = _fake_model(meta)
    model.config.use_cache = False
    if workload.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    install_token_head(model)
    return model


def _measure_sharded(mesh, workload: Workload, meta: torch.nn.Module) -> TrainingMemory:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from tirl.distributed.groups import DistInfo, shard_model

    model = _prepared(workload, meta)
    info = DistInfo(0, mesh.size(), torch.device("cpu"))
    shard_model(model, info, workload.bf16, mesh=mesh)
    optimizer, trainable = _optimizer(model)
    ids = torch.zeros(workload.micro_batch, dtype=torch.long)
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((ids,))
    with tracker:
        _update(model, optimizer, trainable, ids, info, False, tracker.reset_mod_stats)
    return _memory(tracker, model, trainable)


def _measure_one_process(workload: Workload, meta: torch.nn.Module) -> TrainingMemory:
    from torch.distributed._tools.mem_tracker import MemTracker

    from tirl.distributed.groups import DistInfo

    model = _prepared(workload, meta)
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
    optimizer.step()  # the trainer's zero_grad after it only frees memory: it cannot raise the peak


def _memory(tracker, model: torch.nn.Module, trainable: list[torch.nn.Parameter]) -> TrainingMemory:
    # the tracker's one device (FSDPMemTracker and MemTracker both key the snapshot by device)
    stats = next(iter(tracker.get_tracker_snapshot("peak").values()))
    by_category = {_category(k): int(v) for k, v in stats.items() if k != "Total"}
    # between steps: every parameter's shard, and AdamW's two moments of the trained ones
    resident = sum(_local_bytes(p) for p in model.parameters()) + sum(_local_bytes(p) * 2 for p in trainable)
    count = sum(p.numel() for p in trainable)  # a DTensor counts its whole tensor
    return TrainingMemory(int(stats["Total"]), by_category, resident, count)


# One process's tracker names its categories as FSDP's does for the same memory.
_ONE_PROCESS_NAMES = {"Parameter": "Sharded Param", "Gradient": "Sharded Grad", "Optstate": "OptState"}


def _category(key) -> str:
    name = getattr(key, "value", str(key))
    return _ONE_PROCESS_NAMES.get(name, name)


def _local_bytes(p: torch.Tensor) -> int:
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.numel() * local.element_size()
