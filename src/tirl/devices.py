"""The one device and dtype resolution shared by the engines (hf, vllm) and the trainer, and the dtype names a
weight transfer carries (the trainer -> engine sync, vLLM's flat buffer)."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Every dtype a weight transfer carries (floating weights in the engine's dtype, integer and bool
# buffers as they are), by name: plain strings travel in a plan where dtype objects cannot.
WIRE_DTYPES = {
    str(t).removeprefix("torch."): t
    for t in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.uint8,
        torch.bool,
    )
}


def resolve_device(device: str) -> torch.device:
    """ "auto": the GPU when there is one, else the CPU; anything else as torch spells it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """ "auto": bfloat16 on GPU (the paper's precision), float32 on CPU (bf16 matmuls are slow there)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def wire_dtype(name: str) -> torch.dtype:
    """The dtype `name` spells, as str() gives it ("torch.bfloat16") or without the prefix ("bfloat16")."""
    return WIRE_DTYPES[name.removeprefix("torch.")]
