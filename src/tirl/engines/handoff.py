"""The flat handoff: one sync's weights in one flat buffer in the engines' dtype, written once and
opened by every in-process engine's worker without a copy: device memory shared by a CUDA IPC handle
(an engine on the trainer's GPU), or one file in /dev/shm that every other engine's worker maps.

A tmpfs fills silently and a write past its room is a SIGBUS, so the file's pages are reserved
(`posix_fallocate`) before anything maps it: too little room is the error that says how to fix it.

The GPU buffer comes from plain cudaMalloc segments even where the trainer runs on expandable segments
(tirl.distributed.groups.use_expandable_segments): the IPC handle of an expandable segment is opened
with pidfd_getfd, which default container seccomp profiles and pods without ptrace rights refuse.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tirl.devices import wire_dtype

# One tensor of a flat transfer buffer: (name, shape, dtype name, byte offset), plain values that
# vLLM's RPC encoder carries without pickling.
FlatEntry = tuple[str, list[int], str, int]
ALIGN = 64  # bytes: a dtype view of the buffer must start at a multiple of its element size


@dataclass
class FlatHandoff:
    plan: list[FlatEntry]
    nbytes: int
    buf: torch.Tensor  # uint8: on a GPU, or the mapping of `path`
    path: str | None = None  # the shared file behind a host buffer


def flat_layout(
    entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]], dtype: torch.dtype
) -> tuple[list[FlatEntry], int]:
    """Where each (name, shape, dtype) goes in one flat byte buffer, floating ones in `dtype`."""
    plan, offset = [], 0
    for name, shape, own in entries:
        wire = dtype if own.is_floating_point else own
        plan.append((name, list(shape), str(wire).removeprefix("torch."), offset))
        offset += -(-max(1, int(torch.Size(shape).numel())) * wire.itemsize // ALIGN) * ALIGN
    return plan, offset


def pack_flat(tensors: Iterable[tuple[str, torch.Tensor]], plan: list[FlatEntry], buf: torch.Tensor) -> None:
    """Each tensor cast into its slot of `buf` (uint8): the one copy the trainer side makes. `tensors`
    may be a generator that makes each one when its turn comes (an FSDP gather)."""
    for (_, t), (_, shape, dtype, offset) in zip(tensors, plan, strict=True):
        n = t.numel() * wire_dtype(dtype).itemsize
        buf[offset : offset + n].view(wire_dtype(dtype)).view(shape).copy_(t.detach())


def unpack_flat(buf: torch.Tensor, plan: list[FlatEntry]) -> Iterator[tuple[str, torch.Tensor]]:
    """Views into `buf`, no copy."""
    for name, shape, dtype, offset in plan:
        n = max(1, int(torch.Size(shape).numel())) * wire_dtype(dtype).itemsize
        yield name, buf[offset : offset + n].view(wire_dtype(dtype)).view(shape)


def _no_room(directory: str, nbytes: int, free: int) -> OSError:
    return OSError(
        errno.ENOSPC,
        f"weight sync needs {nbytes / 2**30:.2f} GiB in {directory} for the transfer buffer but only "
        f"{free / 2**30:.2f} GiB are free: enlarge it (docker run --shm-size, or mount -o remount,"
        f"size=... {directory}) or set TIRL_WEIGHTS_DIR to a directory with room",
    )


def check_space(directory: str, nbytes: int) -> None:
    """Fail before writing a transfer file that cannot fit (tmpfs fills silently, then SIGBUS)."""
    free = shutil.disk_usage(directory).free
    if free < nbytes:
        raise _no_room(directory, nbytes, free)


def transfer_dir() -> str:
    shm = "/dev/shm"
    return os.environ.get("TIRL_WEIGHTS_DIR") or (shm if os.path.isdir(shm) else tempfile.gettempdir())


def reserve(fd: int, nbytes: int, directory: str) -> None:
    """The file's pages allocated before it is mapped: room taken by another writer since the check
    is the same clear error, not a SIGBUS at the first write past the end."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EFBIG):
            raise _no_room(directory, nbytes, shutil.disk_usage(directory).free) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, nbytes)  # a filesystem without fallocate: the check above is all there is


def expandable_segments_on() -> bool:
    """Whether this process's CUDA allocator was set to expandable segments (by the environment, which
    use_expandable_segments writes too)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
    return "expandable_segments:true" in conf.replace(" ", "").lower()


@contextmanager
def ipc_shareable() -> Iterator[None]:
    """CUDA allocations made meanwhile come from plain segments, whose IPC handle another process opens
    without pidfd_getfd; the allocator's setting is restored right after (the training keeps its own)."""
    if not expandable_segments_on():
        yield
        return
    torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


@contextmanager
def flat_handoff(plan: list[FlatEntry], nbytes: int, device: torch.device) -> Iterator[FlatHandoff]:
    """An empty buffer for `plan`: in `device`'s memory when it is a GPU, else one shared file (checked,
    reserved, mapped; removed on exit)."""
    if device.type == "cuda":
        with ipc_shareable():
            handoff = FlatHandoff(plan, nbytes, torch.empty(nbytes, dtype=torch.uint8, device=device))
        try:
            yield handoff
        finally:
            # The buffer released here, and the IPC bookkeeping of blocks the engines' workers opened
            # and closed with it: without ipc_collect their memory stays reserved until this exits.
            handoff.buf = torch.empty(0, dtype=torch.uint8)
            torch.cuda.ipc_collect()
        return
    directory = transfer_dir()
    check_space(directory, nbytes)
    with tempfile.NamedTemporaryFile(dir=directory, prefix="tirl-weights-") as f:
        reserve(f.fileno(), nbytes, directory)
        buf = torch.from_file(f.name, shared=True, size=nbytes, dtype=torch.uint8)
        yield FlatHandoff(plan, nbytes, buf, f.name)
