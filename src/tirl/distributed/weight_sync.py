"""Bucketed weight sync, trainer -> engines, over a collective group of their own.

The `local` runtime hands the full state dict to in-process engines (`full_model_state`). Across
processes and nodes that would materialise the whole model in one process and ship it whole; here
trainer rank 0 and every engine join a small process group (gloo on CPU, NCCL on GPU; separate from
the trainers' FSDP group), formed once and reused by every sync until the runtime ends
(`SyncChannel`). Per sync, rank 0 broadcasts the plan (names, shapes, dtypes), then streams the
parameters in size-bounded buckets: each parameter is all-gathered from the FSDP shards (every
trainer rank takes part) and cast to the engine's dtype straight into its slot of the bucket, so no
process holds more than one bucket plus one parameter beyond its own shard.

Buckets hold whole layer groups (every parameter of one decoder layer, or one top-level module): the
shards of a merged engine parameter (q/k/v -> qkv_proj, gate/up -> gate_up_proj) never straddle
two buckets. The receiving vLLM worker (`WorkerReceiver`, inside vLLM's worker process) loads the
whole stream in one in-place reload, so a sync is atomic from the engine's view whatever the plan.

Tied embeddings: only `named_parameters()` names travel (a tied head is the embedding's tensor under
one name); each engine backend maps names onto its own tied layout, as the in-process path does.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from tirl.devices import wire_dtype

log = logging.getLogger(__name__)
ALIGN = 64  # bytes
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")  # "model.layers.12.mlp.up_proj.weight" -> "model.layers.12"


@dataclass(frozen=True)
class SyncGroup:
    """Where the members of one sync group meet: rank 0 = trainer rank 0 (the source), 1.. = engines."""

    host: str
    port: int
    world_size: int
    backend: str = "gloo"  # nccl when the buffers live on GPUs
    timeout_s: float = 600.0

    def join(self, rank: int, address: str | None = None) -> dist.ProcessGroup:
        """`address`: this member's routable IP (Ray's node IP), where gloo listens for its peers."""
        timeout = timedelta(seconds=self.timeout_s)
        store = dist.TCPStore(self.host, self.port, self.world_size, rank == 0, timeout=timeout)
        if self.backend == "nccl":
            return dist.ProcessGroupNCCL(store, rank, self.world_size, dist.ProcessGroupNCCL.Options())
        return dist.ProcessGroupGloo(store, rank, self.world_size, gloo_options(timeout, address))

    def as_dict(self) -> dict[str, Any]:
        """Plain values: what vLLM's RPC encoder takes without pickling."""
        return asdict(self)


def gloo_options(timeout: timedelta, address: str | None) -> dist.ProcessGroupGloo._Options:
    """gloo's own pick is the address this host's name resolves to: loopback where /etc/hosts maps it
    to 127.0.1.1 (Debian, Ubuntu images), which members on other nodes cannot reach. The member's
    routable `address` instead, unless GLOO_SOCKET_IFNAME names an interface (the user's choice wins)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    if address and not os.environ.get("GLOO_SOCKET_IFNAME"):
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return opts


class SyncChannel:
    """One member's end of a sync group, joined once and reused by every sync; `close` shuts the
    group down (NCCL communicators otherwise outlive the run)."""

    def __init__(self, group: SyncGroup, rank: int, address: str | None = None):
        self.group, self.rank = group, rank
        self.pg: dist.ProcessGroup | None = group.join(rank, address)
        self.syncs = 0

    def close(self) -> None:
        if self.pg is not None:
            try:
                self.pg.shutdown()
            except Exception as e:  # a member already gone: nothing left to release on our side
                log.debug("sync group shutdown: %s", e)
            self.pg = None


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return wire_dtype(self.dtype).itemsize * max(1, int(torch.Size(self.shape).numel()))

    @property
    def slot(self) -> int:
        """Its room in a bucket: padded so the next entry's dtype view starts aligned."""
        return -(-self.nbytes // ALIGN) * ALIGN


def layer_group(name: str) -> str:
    """The unit a bucket never splits: a decoder layer ("model.layers.3"), else the owning module."""
    m = _LAYER.match(name)
    return m.group(1) if m else name.rpartition(".")[0] or name


def _groups(entries: list[Entry]) -> list[list[Entry]]:
    """Consecutive entries of one layer group together (parameters of a layer are contiguous)."""
    out: list[list[Entry]] = []
    for e in entries:
        if out and layer_group(out[-1][-1].name) == layer_group(e.name):
            out[-1].append(e)
        else:
            out.append([e])
    return out


def plan_buckets(entries: list[Entry], bucket_bytes: int, whole_layers: bool = True) -> list[list[Entry]]:
    """Consecutive whole layer groups per bucket, each bucket within bucket_bytes unless one group
    alone is larger (it then gets a bucket of its own: a merged parameter arrives in one bucket, which
    an engine loading bucket by bucket needs). `whole_layers=False` packs single tensors (tests)."""
    buckets: list[list[Entry]] = []
    size = 0
    for group in _groups(entries) if whole_layers else [[e] for e in entries]:
        nbytes = sum(e.slot for e in group)
        if buckets and size + nbytes <= bucket_bytes:
            buckets[-1].extend(group)
            size += nbytes
        else:
            buckets.append(list(group))
            size = nbytes
    return buckets


@dataclass(frozen=True)
class Lazy:
    """A tensor made only when its bucket is packed (a LoRA layer's merged weight, tirl.rl.lora): its
    shape and dtype for the plan; `make` may run collectives (every FSDP rank calls it, in plan order)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]


Source = torch.Tensor | Lazy

# What a learner's sync carries: every weight, or only the LoRA-adapted layers merged (W + s B A) with
# their fused partners, the rest of the engine's weights staying as they are (tirl.rl.lora).
SyncKind = Literal["full", "lora-merged"]
FULL_SYNC: SyncKind = "full"
LORA_SYNC: SyncKind = "lora-merged"


def plan_entries(
    model: torch.nn.Module, dtype: torch.dtype | None = None, tensors: dict[str, Source] | None = None
) -> list[Entry]:
    """What travels: every named parameter (a tied one once), or `tensors` when given; floating ones
    in the engine's dtype."""
    out = []
    for name, p in (tensors if tensors is not None else dict(model.named_parameters())).items():
        wire = dtype if dtype is not None and p.dtype.is_floating_point else p.dtype
        out.append(Entry(name, tuple(p.shape), str(wire)))
    return out


def _broadcast(pg: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()


def broadcast_pickled(pg: dist.ProcessGroup, obj: object | None, device: torch.device) -> object:
    """Rank 0's object (others pass None) on every member: its size, then its pickled bytes."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    payload = pickle.dumps(obj) if obj is not None else b""
    size[0] = len(payload)
    _broadcast(pg, size)
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if obj is not None:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    _broadcast(pg, buf)
    return pickle.loads(buf.cpu().numpy().tobytes())


def gathered(param: Source) -> torch.Tensor:
    """The whole parameter (an all-gather over the FSDP ranks when it is a DTensor shard; a collective:
    every rank calls it, in the same order)."""
    if isinstance(param, Lazy):
        return param.make()
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def _pack(buf: torch.Tensor | None, bucket: list[Entry], params: dict[str, Source]) -> None:
    """Each parameter gathered and cast into its slot of `buf`: one copy, no staging tensor. Every
    FSDP rank runs the gathers (collectives) even where only rank 0 has a buffer."""
    offset = 0
    for e in bucket:
        full = gathered(params[e.name]).detach()
        if buf is not None:
            buf[offset : offset + e.nbytes].view(wire_dtype(e.dtype)).view(full.shape).copy_(full)
        offset += e.slot


def send_weights(
    model: torch.nn.Module,
    pg: dist.ProcessGroup | None,
    bucket_bytes: int,
    device: torch.device,
    dtype: torch.dtype | None = None,
    whole_layers: bool = True,
    tensors: dict[str, Source] | None = None,
) -> dict[str, float]:
    """Trainer side; every FSDP rank calls it (the gathers are collectives), rank 0 passes `pg`.
    `dtype`: the engines' (floating parameters travel in it: half the bytes of fp32 for bf16).
    `tensors`: what to send instead of the model's parameters (LoRA: the merged adapted layers)."""
    start = time.perf_counter()
    params = tensors if tensors is not None else dict(model.named_parameters())
    buckets = plan_buckets(plan_entries(model, dtype, params), bucket_bytes, whole_layers)
    if pg is not None:
        broadcast_pickled(pg, buckets, device)
    sent = peak = 0
    with torch.no_grad():
        for bucket in buckets:
            size = sum(e.slot for e in bucket)
            buf = torch.empty(size, dtype=torch.uint8, device=device) if pg is not None else None
            _pack(buf, bucket, params)
            if pg is not None:
                _broadcast(pg, buf)
            sent += size
            peak = max(peak, size)
    return {
        "sync/bytes": float(sent),
        "sync/buckets": float(len(buckets)),
        "sync/peak_bucket_bytes": float(peak),
        "sync/send_s": time.perf_counter() - start,
    }


def receive_weights(pg: dist.ProcessGroup, device: torch.device) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Engine side: yields each bucket as (name, tensor) pairs, views into that bucket's own buffer
    (a fresh one per bucket: a loader may hold views of earlier buckets until their layer is done)."""
    buckets = broadcast_pickled(pg, None, device)
    for bucket in buckets:
        buf = torch.empty(sum(e.slot for e in bucket), dtype=torch.uint8, device=device)
        _broadcast(pg, buf)
        pairs, offset = [], 0
        for e in bucket:
            flat = buf[offset : offset + e.nbytes].view(wire_dtype(e.dtype))
            pairs.append((e.name, flat.view(e.shape)))
            offset += e.slot
        yield pairs


def receive_stream(pg: dist.ProcessGroup, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """All buckets of one sync as one stream of (name, tensor): what a single in-place reload eats."""
    for pairs in receive_weights(pg, device):
        yield from pairs


def receive_into(
    pg: dist.ProcessGroup, load: Callable[[list[tuple[str, torch.Tensor]]], None], device: torch.device
) -> int:
    """Receive every bucket of one sync, then `load` them in one call (the engine never serves a
    half-updated model); returns the bytes received. For engines that load in the caller's process."""
    pairs = list(receive_stream(pg, device))
    load(pairs)
    return sum(t.numel() * t.element_size() for _, t in pairs)


class WorkerReceiver:
    """Mixed into vLLM's worker (next to the engine's own extension, which provides `tirl_reload`):
    the engine's end of the sync group lives in the worker process that owns the weights, so buckets
    land on the worker's device with no hop through another process or a file."""

    _tirl_channel: SyncChannel | None = None

    def tirl_reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:  # the engine's extension
        raise NotImplementedError

    def tirl_join(self, group: dict[str, Any], rank: int, address: str | None = None) -> None:
        """`rank`: the engine's first rank; each tensor-parallel worker of it takes the next ones
        (every worker receives the full tensors and keeps its own shard, as from a checkpoint).
        `address`: this node's routable IP (the worker runs on its engine actor's node)."""
        self.tirl_leave()
        self._tirl_channel = SyncChannel(SyncGroup(**group), rank + _tensor_parallel_rank(), address)

    def tirl_receive(self) -> int:
        """One whole sync: every bucket streamed into one in-place reload; the bytes received."""
        channel = self._tirl_channel
        if channel is None or channel.pg is None:
            raise RuntimeError("tirl_receive before tirl_join: this engine is not in a sync group")
        device = self._tirl_device(channel.group)
        received = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal received
            for name, t in receive_stream(channel.pg, device):
                received += t.numel() * t.element_size()
                yield name, t

        self.tirl_reload(counted())
        channel.syncs += 1
        return received

    def tirl_leave(self) -> None:
        if self._tirl_channel is not None:
            self._tirl_channel.close()
            self._tirl_channel = None

    def _tirl_device(self, group: SyncGroup) -> torch.device:
        if group.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _tensor_parallel_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except (ImportError, AssertionError):  # not inside a vLLM worker (tests, the HF engine)
        return 0
