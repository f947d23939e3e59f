"""Data-parallel training with torch FSDP2 (fully_shard): process group, sharding, full state dicts.

One code path for 1 and N processes: with a world of 1 nothing is sharded and every collective is a
no-op. Launch N processes with `torchrun --nproc_per_node=N tirl train ...` (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tirl.devices import resolve_device

# A collective every rank enters at once (the update's, the weight sync's gathers, a checkpoint's) that
# has not completed in this time will not: a rank died, hangs, or is in another collective. The default
# group gets it, so a stuck sync fails in minutes (TIRL_COLLECTIVE_TIMEOUT_S changes it).
COLLECTIVE_TIMEOUT_S = 600.0
# Under torchrun the other ranks wait for rank 0's rollouts (broadcast_object) and its engine moves and
# exports (barrier): up to this long, on the rendezvous store (`RankZeroGate`), before the collective.
WAIT_TIMEOUT = timedelta(hours=4)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    device: torch.device
    waits: Any = None  # a RankZeroGate: where the others wait for rank 0 (None: in the collective)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device_pref: str = "auto") -> DistInfo:
    """Join the torchrun process group when launched by torchrun, else a world of one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(device_pref)
    if device.type == "cuda":
        use_expandable_segments()
    if world == 1:
        return DistInfo(0, 1, device)
    faulthandler.enable()  # a rank that aborts in native code says where in Python it was
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        # The rendezvous waits as long as rank 0's start may take (its memory preflight, a slow import),
        # the collectives after it only the collective timeout.
        dist.init_process_group(backend, timeout=WAIT_TIMEOUT)
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=collective_timeout_s()))
    waits = RankZeroGate(dist.get_rank(), dist.get_world_size())  # rank 0's own work: the others wait
    rank = dist.get_rank()
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return DistInfo(rank, dist.get_world_size(), device, waits)


class RankZeroGate:
    """The other ranks wait for rank 0 on the rendezvous store (the one address every rank reached at
    start; no new group, whose sockets would bind where the hostname resolves), so the collective that
    follows starts with rank 0 present and its short timeout holds. Every rank passes the gates in the
    same order: the n-th gate is key n. Rank 0 passes once every other rank has answered (each sets
    its own key on waking), so none is still waking up when rank 0's first send starts the timeout."""

    def __init__(self, rank: int, world: int = 0) -> None:
        self.rank, self.world, self.passed = rank, world, 0

    def wait(self) -> None:
        self.passed += 1
        store = dist.distributed_c10d._get_default_store()
        key = f"tirl/rank0/{self.passed}"
        if self.rank == 0:  # (a rank that dies meanwhile: torchrun's agent stops the others)
            store.set(key, b"1")
            store.wait([f"{key}/{r}" for r in range(1, self.world)], WAIT_TIMEOUT)
        else:
            store.wait([key], WAIT_TIMEOUT)
            store.set(f"{key}/{self.rank}", b"1")


def wait_for_rank_zero(info: DistInfo) -> None:
    """The other ranks wait here for rank 0 as long as its own work takes (a rollout, an export, reading
    or merging the model), so the collective that follows starts with rank 0 present."""
    gate = getattr(info, "waits", None)
    if gate is not None:
        gate.wait()


def collective_timeout_s() -> float:
    value = os.environ.get("TIRL_COLLECTIVE_TIMEOUT_S")
    try:
        seconds = float(value) if value else COLLECTIVE_TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"TIRL_COLLECTIVE_TIMEOUT_S={value!r}: give a number of seconds > 0")
    return seconds


@contextmanager
def fails_in_minutes(what: str, info: DistInfo) -> Iterator[None]:
    """`what`, a collective every rank takes part in (the weight sync), fails within the collective
    timeout with what to check, instead of hanging: gloo raises (re-raised here with the hint), NCCL's
    watchdog aborts the process (the hint is logged just before)."""
    if not info.enabled:
        yield
        return
    seconds = collective_timeout_s()
    hint = (
        f"{what} did not complete within {seconds:.0f} s on rank {info.rank}: another rank died, hangs or "
        "is in a different collective. Check every rank's log for its first error (and that each reached "
        "this step's sync), NCCL_DEBUG=INFO for the collective each rank is in, the network between the "
        "nodes; TIRL_COLLECTIVE_TIMEOUT_S sets the limit"
    )
    timer = threading.Timer(seconds * 0.95, log.error, args=(hint,))
    timer.daemon = True
    start = time.monotonic()
    timer.start()
    try:
        yield
    except (RuntimeError, dist.DistError) as e:
        if time.monotonic() - start < seconds * 0.9:
            raise  # an error of its own, not a wait that ran out
        raise TimeoutError(f"{hint} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    finally:
        timer.cancel()


def use_expandable_segments() -> None:
    """The CUDA allocator `tirl plan` assumes (tirl.rl.plan.allocator_slack): expandable segments,
    unless the user set PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF. Applied to the running allocator
    too (CUDA may be up already); child processes inherit the variable."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def shutdown_distributed(synchronize: bool) -> None:
    """Leave the process group. After a clean run all ranks first meet in a barrier (rank 0 may still
    be writing the last checkpoint) and drop their last collective handles while the interpreter is
    alive: a gloo rank that tears its group down while a peer is still in flight, or exits with work
    objects pending, can abort at exit (SIGABRT, "terminate called without an active exception").
    After an error there is no barrier: a peer that died would make it wait for the full timeout."""
    if not dist.is_initialized():
        return
    if synchronize:
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()


def shard_model(model: torch.nn.Module, info: DistInfo, bf16: bool, mesh=None) -> torch.nn.Module:
    """FSDP2: shard each decoder layer, then the root (embeddings, norm, head). `mesh`: a device mesh
    made beforehand (the memory planner builds one outside its fake-tensor mode)."""
    if not info.enabled:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = mesh or init_device_mesh(info.device.type, (info.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs: dict[str, Any] = {"mesh": mesh} | ({"mp_policy": mp} if mp else {})
    for layer in _decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__} (expected model.model.layers)"
        )
    return list(layers)


def _options(cpu: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu)


def full_model_state(model: torch.nn.Module, info: DistInfo) -> dict[str, torch.Tensor]:
    """The unsharded weights on CPU (rank 0 only under FSDP; a collective: every rank calls it)."""
    if not info.enabled:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options())


def full_optimizer_state(model, optimizer, info: DistInfo) -> dict:
    if not info.enabled:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options())


def all_reduce(values: list[float], info: DistInfo, op: str = "sum") -> list[float]:
    """Reduce a few floats over ranks (sum or max)."""
    if not info.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=info.device if info.device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.tolist()


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's object on every rank (the others may wait for it as long as a rollout takes)."""
    if not info.enabled:
        return obj
    box = [obj]
    wait_for_rank_zero(info)
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(info: DistInfo) -> None:
    """Every rank here (waiting as long as rank 0's engine moves or an export take)."""
    if info.enabled:
        wait_for_rank_zero(info)
        dist.barrier()


# ---- sharded checkpoints (torch.distributed.checkpoint) ----
#
# Each rank writes and reads only its own shards of the fp32 weights and the AdamW moments: nothing is
# gathered on rank 0 (a full 14B optimizer state is 118 GB) and nothing passes through a pickle. The same
# calls work in a single process, where DCP runs without a process group.


def _training_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False
) -> dict[str, Any]:
    """The weights (with `trainable_only`, those that train: a LoRA run's adapters, not its frozen
    base) and the optimizer state."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    weights = get_model_state_dict(model)
    if trainable_only:
        names = {n for n, p in model.named_parameters() if p.requires_grad}
        weights = {k: v for k, v in weights.items() if k in names}
    return {"model": weights, "optim": get_optimizer_state_dict(model, optimizer)}


@contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """DCP warns each time it runs without a process group; in a world of one that is the design."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def save_sharded(
    path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False
) -> None:
    """Write this rank's shards of the weights and optimizer state under `path` (a collective)."""
    import torch.distributed.checkpoint as dcp

    with _single_process_is_intended():
        dcp.save(_training_state(model, optimizer, trainable_only), checkpoint_id=str(path))


def load_sharded(
    path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False
) -> None:
    """Read this rank's shards back into the model and optimizer (a collective); with the same world
    size each rank reads exactly the files it wrote. `trainable_only`: the checkpoint holds only the
    trained weights (LoRA); the others stay as loaded."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from tirl.distributed.checkpoint_reader import load_safely

    state = _training_state(model, optimizer, trainable_only)  # the shapes and shardings to read into
    with _single_process_is_intended():
        load_safely(state, path)  # no pickle of the checkpoint runs code (see checkpoint_reader)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not trainable_only))
    set_optimizer_state_dict(model, optimizer, state["optim"])


# ---- the Hugging Face export ----

EXPORT_FILE_BYTES = 4 * 2**30  # safetensors files of at most this size, as HF shards its own


def _export_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a model directory holds: the parameters (a tied one once) and persistent buffers."""
    found = list(model.named_parameters())
    for module_name, module in model.named_modules():
        skip = getattr(module, "_non_persistent_buffers_set", set())
        for name, buf in module.named_buffers(recurse=False):
            if name not in skip:
                found.append((f"{module_name}.{name}" if module_name else name, buf))
    return found


def _export_files(tensors: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    files: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()  # a DTensor reports its global shape
        if files[-1] and size + nbytes > EXPORT_FILE_BYTES:
            files.append([])
            size = 0
        files[-1].append((name, t))
        size += nbytes
    return files


def export_hf_model(model: torch.nn.Module, out_dir, info: DistInfo) -> None:
    """Write the model as a Hugging Face directory (config + sharded safetensors + index), gathering one
    tensor at a time (a collective: every rank calls it); rank 0 holds at most one file on the host."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(out_dir)
    files = _export_files(_export_tensors(model))
    # HF's own naming: one file is model.safetensors, several are numbered and indexed.
    names = (
        ["model.safetensors"]
        if len(files) == 1
        else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    )
    weight_map, total = {}, 0
    for fname, group in zip(names, files, strict=True):
        tensors = {}
        for name, t in group:
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            if info.is_main:
                tensors[name] = full.detach().to("cpu", copy=True).contiguous()
                weight_map[name] = fname
                total += full.numel() * full.element_size()
            del full
        if info.is_main:
            out.mkdir(parents=True, exist_ok=True)
            save_file(tensors, out / fname, metadata={"format": "pt"})
    if info.is_main:
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        model.config.save_pretrained(out)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(out)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, info: DistInfo) -> torch.Tensor:
    """Clip the gradients to a global L2 norm of max_norm; returns the norm before clipping (0-dim).

    Computed on each rank's own shards: a sum of squares per rank, all-reduced. (torch's
    clip_grad_norm_ on FSDP2's DTensor gradients materializes a full-size fp32 copy of every gradient
    on each rank, a 59 GB transient at 14B, as `tirl plan` measured.) FSDP2 shards every parameter
    along dim 0 without overlap, so the local sums add up to the global one exactly once."""
    grads = [
        p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None
    ]
    device = grads[0].device if grads else info.device
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        squares += g.detach().float().pow(2).sum()
    if info.enabled:
        dist.all_reduce(squares)
    norm = squares.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return norm
