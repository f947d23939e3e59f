"""Bucketed weight sync, trainer -> engines, over a collective group of their own.

The `local` runtime hands the full state dict to in-process engines (`full_model_state`). Across
processes and nodes that would materialise the whole model in one process and ship it whole; here
trainer rank 0 and every engine worker join a small process group (gloo on CPU, NCCL on GPU; it is
separate from the trainers' FSDP group), rank 0 broadcasts the plan (names, shapes, dtypes), then
streams the parameters in size-bounded buckets: each parameter is all-gathered from the FSDP shards
(every trainer rank takes part) just before it is packed, so no process ever holds more than one
bucket plus one parameter beyond its own shard. Engines unpack a bucket and `load_weights` it.

Tied embeddings: only `named_parameters()` names travel (a tied head is the embedding's tensor under
one name); each engine backend maps names onto its own tied layout (HFEngine via its state dict,
VLLMEngine via its own load_weights), exactly as the in-process path does.
"""

from __future__ import annotations

import pickle
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_DTYPES = {str(t): t for t in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


@dataclass(frozen=True)
class SyncGroup:
    """Where the members of one sync meet: rank 0 = trainer rank 0 (the source), 1.. = engines."""

    host: str
    port: int
    world_size: int
    backend: str = "gloo"  # nccl when the buffers live on GPUs
    timeout_s: float = 600.0

    def join(self, rank: int) -> dist.ProcessGroup:
        store = dist.TCPStore(
            self.host, self.port, self.world_size, rank == 0, timeout=timedelta(seconds=self.timeout_s)
        )
        timeout = timedelta(seconds=self.timeout_s)
        if self.backend == "nccl":
            return dist.ProcessGroupNCCL(store, rank, self.world_size, dist.ProcessGroupNCCL.Options())
        return dist.ProcessGroupGloo(store, rank, self.world_size, timeout)


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return _DTYPES[self.dtype].itemsize * max(1, int(torch.Size(self.shape).numel()))


def plan_buckets(entries: list[Entry], bucket_bytes: int) -> list[list[Entry]]:
    """Consecutive parameters grouped so each bucket stays within bucket_bytes (a larger parameter
    gets a bucket of its own)."""
    buckets: list[list[Entry]] = []
    size = 0
    for e in entries:
        if buckets and size + e.nbytes <= bucket_bytes:
            buckets[-1].append(e)
            size += e.nbytes
        else:
            buckets.append([e])
            size = e.nbytes
    return buckets


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


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


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter (an all-gather over the FSDP ranks when it is a DTensor shard)."""
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def send_weights(
    model: torch.nn.Module, pg: dist.ProcessGroup | None, bucket_bytes: int, device: torch.device
) -> dict[str, float]:
    """Trainer side; every FSDP rank calls it (the gathers are collectives), rank 0 passes `pg`."""
    params = dict(model.named_parameters())
    entries = [Entry(n, tuple(p.shape), str(p.dtype)) for n, p in params.items()]
    buckets = plan_buckets(entries, bucket_bytes)
    if pg is not None:
        broadcast_pickled(pg, buckets, device)
    sent = peak = 0
    with torch.no_grad():
        for bucket in buckets:
            size = sum(e.nbytes for e in bucket)
            buf = torch.empty(size, dtype=torch.uint8, device=device) if pg is not None else None
            offset = 0
            for e in bucket:
                full = _full(params[e.name]).detach()
                if buf is not None:
                    buf[offset : offset + e.nbytes].copy_(full.reshape(-1).view(torch.uint8))
                offset += e.nbytes
            if pg is not None:
                _broadcast(pg, buf)
            sent += size
            peak = max(peak, size)
    return {
        "sync/bytes": float(sent),
        "sync/buckets": float(len(buckets)),
        "sync/peak_bucket_bytes": float(peak),
    }


def receive_weights(pg: dist.ProcessGroup, device: torch.device) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Engine side: yields each bucket as (name, tensor) pairs, views into that bucket's buffer."""
    buckets = broadcast_pickled(pg, None, device)
    for bucket in buckets:
        buf = torch.empty(sum(e.nbytes for e in bucket), dtype=torch.uint8, device=device)
        _broadcast(pg, buf)
        pairs, offset = [], 0
        for e in bucket:
            flat = buf[offset : offset + e.nbytes].view(_DTYPES[e.dtype])
            pairs.append((e.name, flat.view(e.shape)))
            offset += e.nbytes
        yield pairs


def receive_into(
    group: SyncGroup, rank: int, load: Callable[[list[tuple[str, torch.Tensor]]], None], device: torch.device
) -> int:
    """Join `group` as `rank`, load every bucket with `load`; returns the bytes received."""
    pg = group.join(rank)
    received = 0
    for pairs in receive_weights(pg, device):
        load(pairs)
        received += sum(t.numel() * t.element_size() for _, t in pairs)
    return received
