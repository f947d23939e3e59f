"""The one device and dtype resolution shared by the engines (hf, vllm) and the trainer."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
