"""Advantage estimators: one kept group's rewards -> one advantage per trajectory (on all its tokens).

Chosen by `algorithm.advantage`: a name of ADVANTAGES or a `module:function` path to your own
`(rewards: Sequence[float]) -> list[float]`.

- "grpo" (the paper): A_i = (r_i - mean(r)) / (std(r) + eps), std the unbiased sample std (as torch.std
  and the paper's release).
- "dr_grpo" (Dr.GRPO, Liu et al. 2025): A_i = r_i - mean(r). Dividing by std up-weights groups whose
  rewards barely differ (very easy or very hard prompts); Dr.GRPO removes that difficulty bias. Pair it
  with `loss_normalization=constant` to remove the length bias too.

A group of one, or with equal rewards, has no relative signal: its advantages are 0 under both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tirl.plugins import resolve

AdvantageFn = Callable[[Sequence[float]], list[float]]


def _centered(rewards: Sequence[float]) -> torch.Tensor | None:
    r = torch.tensor(list(rewards), dtype=torch.float64)
    return None if r.numel() < 2 else r - r.mean()


def grpo(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    centered = _centered(rewards)
    if centered is None:
        return [0.0] * len(rewards)
    return (centered / (centered.std() + eps)).tolist()


def dr_grpo(rewards: Sequence[float]) -> list[float]:
    centered = _centered(rewards)
    return [0.0] * len(rewards) if centered is None else centered.tolist()


ADVANTAGES: dict[str, AdvantageFn] = {"grpo": grpo, "dr_grpo": dr_grpo}


def resolve_advantage(spec: str) -> AdvantageFn:
    fn = resolve("advantage estimator", ADVANTAGES, spec)
    if not callable(fn):
        raise ValueError(f"advantage estimator {spec!r} is not a function (rewards) -> advantages")
    return fn
