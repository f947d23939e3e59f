"""Resample-on-Correct (RoC): down-sample an oversampled group of 2G rollouts to G (docs/method.md §3).

Negatives (reward 0) are kept uniformly at random, without ranking. Positives (reward 1) are kept by
sampling WITHOUT replacement with probability proportional to 1/p_total, where

    p_total = p_err + p_format
    p_err    = tool calls that errored / tool calls        (0.5 when the trajectory made no call)
    p_format = 1 if there is no <answer> block, else min(1, (answer blocks - 1) / turns)

so correct trajectories with clean tool use and a single answer are the ones trained on.

A perfect positive (p_total = 0: tool calls without an error, exactly one answer; the most common
good trajectory) has weight 1/0 = infinity. mode "sample" takes that limit literally: perfect
positives fill the positive slots first, uniformly among themselves, and only the slots left are
drawn from the imperfect ones by 1/p_total. The paper's release replaces the sampling with a
deterministic top-k ("topk" here).

How the G slots split (the paper keeps floor(n_neg/2) negatives and "half" the positives of 2G):
negatives get floor(n_neg * keep / n) slots and positives take the rest, i.e. ceil(n_pos/2) for
n = 2G. When the two halves are odd, the extra slot therefore goes to the positives: the filtered
class is the one RoC is about, and a clean positive is the scarcer signal. A class that runs out
hands its slots to the other, so exactly min(keep, n) members are kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

RocMode = Literal["sample", "topk", "off"]


class RocMember(Protocol):
    """What RoC reads from a rollout (tirl.agent.trajectory.Trajectory has all of it)."""

    reward: float
    num_tool_calls: int
    num_tool_errors: int
    answer_blocks: int
    turns: int


@dataclass(frozen=True)
class Penalties:
    p_err: float
    p_format: float

    @property
    def p_total(self) -> float:
        return self.p_err + self.p_format


def penalties(member: RocMember, no_tool_p_err: float = 0.5) -> Penalties:
    """The paper's two quality penalties of one trajectory."""
    calls = member.num_tool_calls
    p_err = member.num_tool_errors / calls if calls else no_tool_p_err
    blocks = member.answer_blocks
    p_format = 1.0 if blocks == 0 else min(1.0, (blocks - 1) / max(member.turns, 1))
    return Penalties(p_err=p_err, p_format=p_format)


def is_positive(member: RocMember) -> bool:
    return member.reward > 0.5


def split_slots(n_pos: int, n_neg: int, keep: int, min_per_class: int = 0) -> tuple[int, int]:
    """(positive slots, negative slots) summing to min(keep, n_pos + n_neg); see the module doc."""
    n = n_pos + n_neg
    keep = min(keep, n)
    if n == 0:
        return 0, 0
    # Slots in proportion to the class sizes, then each class its minimum where it has members (the
    # release keeps >= 2 of each). Neither class can get more slots than members: keep <= n makes
    # keep - floor(n_neg * keep / n) = ceil(n_pos * keep / n) <= n_pos, and the minima are capped by size.
    need_neg = min(min_per_class, n_neg, keep)
    need_pos = min(min_per_class, n_pos, keep - need_neg)
    k_neg = max((n_neg * keep) // n, need_neg)
    k_pos = max(keep - k_neg, need_pos)
    return k_pos, keep - k_pos


def resample_on_correct(
    group: Sequence[RocMember],
    keep: int,
    rng: np.random.Generator,
    *,
    mode: RocMode = "sample",
    min_per_class: int = 0,
    drop_uniform: bool = False,
    no_tool_p_err: float = 0.5,
) -> list[int]:
    """Indices (ascending) of the members of `group` to train on.

    mode: "sample" = the paper (1/p_total sampling of positives, perfect ones first: see the module doc);
    "topk" = the release's deterministic
    variant (the `k` positives with the lowest p_total, ties by position); "off" = plain GRPO (the first
    `keep` members). drop_uniform: return [] for a group whose rewards are all equal (no signal).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if not group:
        return []
    if drop_uniform and len({is_positive(m) for m in group}) == 1:
        return []
    if mode == "off":
        return list(range(min(keep, len(group))))
    pos = [i for i, m in enumerate(group) if is_positive(m)]
    neg = [i for i, m in enumerate(group) if not is_positive(m)]
    k_pos, k_neg = split_slots(len(pos), len(neg), keep, min_per_class)

    kept_neg = rng.choice(neg, size=k_neg, replace=False).tolist() if k_neg else []
    p_totals = [penalties(group[i], no_tool_p_err).p_total for i in pos]
    if mode == "topk":
        order = sorted(range(len(pos)), key=lambda j: (p_totals[j], j))
        kept_pos = [pos[j] for j in order[:k_pos]]
    elif mode == "sample":
        kept_pos = _perfect_first(pos, p_totals, k_pos, rng)
    else:
        raise ValueError(f"unknown RoC mode {mode!r}: use sample, topk or off")
    return sorted(int(i) for i in kept_pos + kept_neg)


def _perfect_first(pos: list[int], p_totals: list[float], k: int, rng) -> list[int]:
    """The limit of 1/p_total sampling: perfect members (p_total = 0) first, uniformly; the slots left
    by 1/p_total among the others."""
    perfect = [i for i, p in zip(pos, p_totals, strict=True) if p == 0]
    if len(perfect) >= k:
        return rng.choice(perfect, size=k, replace=False).tolist() if k else []
    rest = [(i, p) for i, p in zip(pos, p_totals, strict=True) if p > 0]
    weights = np.array([1.0 / p for _, p in rest])
    return perfect + _sample_without_replacement([i for i, _ in rest], weights, k - len(perfect), rng)


def _sample_without_replacement(items: list[int], weights: np.ndarray, k: int, rng) -> list[int]:
    """Successive draws, each proportional to the weights of the items not yet drawn."""
    if k == 0:
        return []
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ValueError(f"RoC weights must be finite and positive, got {weights}")
    return rng.choice(items, size=k, replace=False, p=weights / weights.sum()).tolist()
