"""Statistics over seeds for `tirl demo --compare grpo --seeds N`: mean and 95% interval per RL step.

Every run of a comparison starts from the same SFT model; a seed changes only the RL run (prompt
order, sampling, RoC's draws), and GRPO-RoC and plain GRPO with the same seed see the same prompts in
the same order. So a per-seed difference RoC - GRPO is a paired sample, and its interval says whether
the effect is larger than seed-to-seed noise. Intervals are Student-t (few seeds: wide on purpose).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The quantities the paper compares (its Figures 4 and 9): metrics key -> (title, scale to display).
CURVES = {
    "reward/mean": ("Reward (training rollouts)", 1.0),
    "tools/error_ratio_in_correct": ("Tool-error ratio in correct trajectories (%)", 100.0),
    "response/length_mean": ("Response length (tokens)", 1.0),
    "tools/calls_per_traj": ("Tool calls per trajectory", 1.0),
}


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int

    def to_dict(self) -> dict:
        return {
            "mean": round(self.mean, 4),
            "low": round(self.low, 4),
            "high": round(self.high, 4),
            "n": self.n,
        }


def interval(values: list[float], level: float = 0.95) -> Interval | None:
    """Mean and Student-t interval of `values` (None when empty; a single value has no width)."""
    from scipy.stats import t

    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    n, mean = len(xs), sum(xs) / len(xs)
    if n == 1:
        return Interval(mean, mean, mean, 1)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = float(t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def per_step(seeds: list[list[dict]], key: str) -> dict[int, Interval]:
    """For each step, the interval of `key` over the seeds that logged a value there."""
    values: dict[int, list[float]] = {}
    for rows in seeds:
        for row in rows:
            if row.get(key) is not None:
                values.setdefault(int(row["step"]), []).append(row[key])
    return {step: iv for step, xs in sorted(values.items()) if (iv := interval(xs)) is not None}


def window_mean(rows: list[dict], key: str, last: int) -> float | None:
    """Mean of `key` over the run's last `last` steps that logged it."""
    vals = [r[key] for r in rows if r.get(key) is not None][-last:]
    return sum(vals) / len(vals) if vals else None


def paired_difference(a: list[float | None], b: list[float | None]) -> Interval | None:
    """Interval of a - b over the seeds where both exist (same seed = same prompts: paired)."""
    return interval([x - y for x, y in zip(a, b, strict=True) if x is not None and y is not None])


def summarize(training: dict[str, list[list[dict]]], accuracy: dict[str, list[float]], last: int = 5) -> dict:
    """The comparison's numbers: per-step bands, last-`last`-step means and held-out accuracy, each
    with its interval, and the paired differences of the first run against the second."""
    names = list(training)
    out: dict = {"seeds": len(next(iter(training.values()))), "last_steps": last, "curves": {}, "final": {}}
    for key in CURVES:
        out["curves"][key] = {
            name: {step: iv.to_dict() for step, iv in per_step(runs, key).items()}
            for name, runs in training.items()
        }
        finals = {name: [window_mean(rows, key, last) for rows in runs] for name, runs in training.items()}
        out["final"][key] = {name: _dict(interval(v)) for name, v in finals.items()}
        if len(names) == 2:
            out["final"][key]["difference"] = _dict(paired_difference(finals[names[0]], finals[names[1]]))
    out["heldout_accuracy"] = {name: _dict(interval(v)) | {"per_seed": v} for name, v in accuracy.items()}
    if len(names) == 2 and all(n in accuracy for n in names):
        out["heldout_accuracy"]["difference"] = _dict(
            paired_difference(accuracy[names[0]], accuracy[names[1]])
        )
    return out


def _dict(iv: Interval | None) -> dict | None:
    return None if iv is None else iv.to_dict()
