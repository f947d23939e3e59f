"""Statistics over seeds for `tirl demo --compare grpo --seeds N`: mean and 95% interval per RL step.

Every run of a comparison starts from the same SFT model; a seed changes only the RL run (prompt
order, sampling, RoC's draws), and GRPO-RoC and plain GRPO with the same seed see the same prompts in
the same order. So a per-seed difference RoC - GRPO is a paired sample, and its interval says whether
the effect is larger than seed-to-seed noise. Intervals are Student-t (few seeds: wide on purpose);
a difference also carries the two-sided p-value of the paired t-test against zero (`p`), which is below
0.05 exactly when its 95% interval excludes zero. `change` is each run's own trend: its last steps' mean
minus its first steps' (the paper's "falls under RoC, plateaus under GRPO" is a claim about it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

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
    p: float | None = None  # a difference's two-sided t-test against zero; None for plain means

    def to_dict(self) -> dict:
        out = {
            "mean": round(self.mean, 4),
            "low": round(self.low, 4),
            "high": round(self.high, 4),
            "n": self.n,
        }
        return out if self.p is None else out | {"p": round(self.p, 4)}


def _mean_sd(values: list[float | None]) -> tuple[int, float, float]:
    """(n, mean, sample standard deviation) of the values that exist (sd 0 below two)."""
    xs = [float(v) for v in values if v is not None]
    n = len(xs)
    mean = sum(xs) / n if n else 0.0
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return n, mean, sd


def interval(values: list[float], level: float = 0.95) -> Interval | None:
    """Mean and Student-t interval of `values` (None when empty; a single value has no width)."""
    from scipy.stats import t

    n, mean, sd = _mean_sd(values)
    if n == 0:
        return None
    if n == 1:
        return Interval(mean, mean, mean, 1)
    half = float(t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def against_zero(values: list[float | None], level: float = 0.95) -> Interval | None:
    """`interval` of differences, with the two-sided p-value of the one-sample t-test of mean zero (None
    for one value: no test). No spread (rounding aside) gives p 0, or 1 for a mean of zero."""
    from scipy.stats import t

    iv = interval(values, level)
    if iv is None or iv.n < 2:
        return iv
    n, mean, sd = _mean_sd(values)
    if sd <= 1e-12 * max(1.0, abs(mean)):
        return replace(iv, p=1.0 if abs(mean) <= 1e-12 else 0.0)
    return replace(iv, p=float(2 * t.sf(abs(mean) / (sd / math.sqrt(n)), n - 1)))


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


def window_change(rows: list[dict], key: str, window: int) -> float | None:
    """The run's trend in `key`: mean over its last `window` steps minus mean over its first `window`."""
    vals = [r[key] for r in rows if r.get(key) is not None]
    if len(vals) < 2 * window:
        return None
    return sum(vals[-window:]) / window - sum(vals[:window]) / window


def paired_difference(a: list[float | None], b: list[float | None]) -> Interval | None:
    """Interval and t-test of a - b over the seeds where both exist (same seed = same prompts: paired)."""
    return against_zero([x - y for x, y in zip(a, b, strict=True) if x is not None and y is not None])


def summarize(training: dict[str, list[list[dict]]], accuracy: dict[str, list[float]], last: int = 5) -> dict:
    """The comparison's numbers: per-step bands, last-`last`-step means and held-out accuracy, each
    with its interval, and the paired differences of the first run against the second."""
    names = list(training)
    out: dict = {
        "seeds": len(next(iter(training.values()))),
        "last_steps": last,
        "curves": {},
        "final": {},
        "change": {},
    }
    for key in CURVES:
        out["curves"][key] = {
            name: {step: iv.to_dict() for step, iv in per_step(runs, key).items()}
            for name, runs in training.items()
        }
        finals = {name: [window_mean(rows, key, last) for rows in runs] for name, runs in training.items()}
        out["final"][key] = {name: _dict(interval(v)) for name, v in finals.items()}
        changes = {name: [window_change(rows, key, last) for rows in runs] for name, runs in training.items()}
        out["change"][key] = {name: _dict(against_zero(v)) for name, v in changes.items()}
        if len(names) == 2:
            out["final"][key]["difference"] = _dict(paired_difference(finals[names[0]], finals[names[1]]))
            out["change"][key]["difference"] = _dict(paired_difference(changes[names[0]], changes[names[1]]))
    out["heldout_accuracy"] = {name: _dict(interval(v)) | {"per_seed": v} for name, v in accuracy.items()}
    if len(names) == 2 and all(n in accuracy for n in names):
        out["heldout_accuracy"]["difference"] = _dict(
            paired_difference(accuracy[names[0]], accuracy[names[1]])
        )
    return out


def _dict(iv: Interval | None) -> dict | None:
    return None if iv is None else iv.to_dict()


ERR_KEY = "tools/error_ratio_in_correct"
# The paper's claims about GRPO-RoC ("rl") against plain GRPO ("grpo"), its Figures 4 and 9, each as
# (claim, summary section, metrics key, run or "difference" = rl - grpo, what the claim expects).
PAPER_CLAIMS = (
    ("tool-error ratio in correct trajectories falls under RoC", "change", ERR_KEY, "rl", "lower"),
    ("tool-error ratio in correct trajectories plateaus under GRPO", "change", ERR_KEY, "grpo", "no change"),
    ("RoC ends with fewer tool errors in correct trajectories", "final", ERR_KEY, "difference", "lower"),
    ("RoC ends with shorter responses", "final", "response/length_mean", "difference", "lower"),
    ("RoC's held-out accuracy is not worse", "heldout_accuracy", None, "difference", "not lower"),
)
UNTESTED = {"lower": "not shown", "no change": "consistent", "not lower": "consistent"}


def verdict(iv: dict | None, expects: str, alpha: float = 0.05) -> str:
    """Whether a tested difference supports a claim: significant (p < alpha) in the claimed direction,
    significant against it, or not distinguishable from zero (which supports only "no change" and "not
    lower" claims, and only as an absence of evidence against them)."""
    if iv is None or iv.get("p") is None:
        return "not testable (fewer than 2 seeds with a value)"
    p, below = iv["p"], iv["mean"] < 0
    if p >= alpha:
        return f"{UNTESTED[expects]} (p={p:.3f})"
    if expects == "lower":
        return f"{'yes' if below else 'no: the opposite'} (p={p:.3f})"
    if expects == "not lower" and not below:
        return f"yes, higher (p={p:.3f})"
    return f"no: {'lower' if below else 'higher'} (p={p:.3f})"


def claims(comparison: dict) -> list[dict]:
    """Each of PAPER_CLAIMS with its tested difference (in display units) and verdict, from `summarize`
    of the runs rl and grpo (in that order)."""
    rows = []
    for claim, section, key, run, expects in PAPER_CLAIMS:
        iv = (comparison[section] if key is None else comparison[section][key]).get(run)
        scale = CURVES[key][1] if key else 1.0
        shown = iv and {k: v * scale if k in ("mean", "low", "high") else v for k, v in iv.items()}
        rows.append(
            {
                "claim": claim,
                "tested": f"{section}: {run}",
                "interval": shown,
                "verdict": verdict(iv, expects),
            }
        )
    return rows
