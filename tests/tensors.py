"""Tensors written out by hand in the objective's tests: float64, so expected values are exact."""

from __future__ import annotations

import torch

F64 = torch.float64


def t(rows, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


def log_t(rows) -> torch.Tensor:
    """The log of float64 values: log-probs from probabilities, log-ratios from ratios."""
    return torch.log(t(rows))
