"""PNG plots of training and evaluation metrics (matplotlib, headless).

Training curves read the trainer's metrics.jsonl rows (tirl.rl.metrics.read_metrics); several runs go
on one figure so GRPO-RoC and plain GRPO compare at a glance. Tiny runs are noisy: each curve is drawn
raw (thin) and as a moving average (thick).
"""

from __future__ import annotations

from pathlib import Path

# The quantities the paper tracks during RL: (metrics key, title, y label, file name, scale).
TRAINING_CURVES = (
    ("reward/mean", "Reward (training rollouts)", "mean reward", "reward.png", 1.0),
    ("response/length_mean", "Response length", "tokens per trajectory", "response_length.png", 1.0),
    (
        "tools/error_ratio_in_correct",
        "Tool-error ratio in correct trajectories",
        "errored calls / calls (%)",
        "tool_error_ratio_in_correct.png",
        100.0,
    ),
    ("tools/calls_per_traj", "Tool calls per trajectory", "calls", "tool_calls.png", 1.0),
)
LABELS = {"rl": "GRPO-RoC", "grpo": "plain GRPO", "sft": "SFT"}
COLORS = {"sft": "C7", "rl": "C0", "grpo": "C1"}  # one color per model in every figure


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` points (the first points average what exists)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_curve(
    runs: dict[str, list[dict]], key: str, title: str, ylabel: str, path: Path, scale: float = 1.0
) -> Path:
    """One metric per step for each run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, (name, rows) in enumerate(runs.items()):
        points = [(r["step"], scale * r[key]) for r in rows if r.get(key) is not None]  # None: n/a
        if not points:
            continue
        steps, values = zip(*points, strict=True)
        color = COLORS.get(name, f"C{i + 2}")
        ax.plot(steps, values, color=color, alpha=0.3, linewidth=1)
        window = max(1, len(values) // 8)
        ax.plot(
            steps,
            moving_average(list(values), window),
            color=color,
            linewidth=2,
            label=LABELS.get(name, name),
        )
    ax.set(title=title, xlabel="RL step", ylabel=ylabel)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers (no 0.5 ticks)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_training(runs: dict[str, list[dict]], out_dir: str | Path) -> list[Path]:
    """The standard training curves of one or more runs; returns the PNG paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        plot_curve(runs, key, title, ylabel, out / name, scale)
        for key, title, ylabel, name, scale in TRAINING_CURVES
    ]


def plot_accuracy(
    accuracy: dict[str, float], out_dir: str | Path, name: str = "heldout_accuracy.png"
) -> Path:
    """Held-out accuracy (%) of each model, as bars."""
    plt = _pyplot()
    labels = [LABELS.get(k, k) for k in accuracy]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    bars = ax.bar(
        labels, list(accuracy.values()), color=[COLORS.get(k, f"C{i + 2}") for i, k in enumerate(accuracy)]
    )
    ax.bar_label(bars, fmt="%.1f")
    ax.set(title="Held-out accuracy", ylabel="pass@1 (%)", ylim=(0, 105))
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path = Path(out_dir) / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bands(ax, curves: dict[str, dict], scale: float) -> None:
    """Mean per step (line) and its 95% interval over seeds (band), one color per run."""
    for i, (name, by_step) in enumerate(curves.items()):
        if not by_step:
            continue
        steps = [int(s) for s in by_step]
        mean, low, high = ([scale * by_step[s][k] for s in by_step] for k in ("mean", "low", "high"))
        color = COLORS.get(name, f"C{i + 2}")
        ax.plot(steps, mean, color=color, linewidth=2, label=LABELS.get(name, name))
        ax.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)
    ax.set(xlabel="RL step")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()


def plot_comparison(summary: dict, out_dir: str | Path, title: str = "GRPO-RoC vs plain GRPO") -> list[Path]:
    """The multi-seed comparison (tirl.demo.seed_stats.summarize) as the paper's Figure 4 (tool-error ratio
    in correct trajectories) and Figure 9 (reward, held-out accuracy, response length, tool calls)."""
    from tirl.demo.seed_stats import CURVES

    plt = _pyplot()
    out = Path(out_dir)
    n = summary["seeds"]
    key = "tools/error_ratio_in_correct"
    fig, ax = plt.subplots(figsize=(6, 3.8))
    _bands(ax, summary["curves"][key], CURVES[key][1])
    ax.set(title=f"{CURVES[key][0]}\nmean and 95% interval over {n} seeds", ylabel="errored calls (%)")
    fig.tight_layout()
    fig.savefig(out / "figure4.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, key in zip(
        axes.flat, ("reward/mean", "response/length_mean", "tools/calls_per_traj"), strict=False
    ):
        _bands(ax, summary["curves"][key], CURVES[key][1])
        ax.set(title=CURVES[key][0])
    acc = {k: v for k, v in summary["heldout_accuracy"].items() if k != "difference" and v}
    ax = axes.flat[3]
    names = list(acc)
    means = [acc[k]["mean"] for k in names]
    errors = [
        [acc[k]["mean"] - acc[k]["low"] for k in names],
        [acc[k]["high"] - acc[k]["mean"] for k in names],
    ]
    colors = [COLORS.get(k, f"C{i + 2}") for i, k in enumerate(names)]
    bars = ax.bar([LABELS.get(k, k) for k in names], means, yerr=errors, capsize=6, color=colors)
    ax.bar_label(bars, fmt="%.1f", label_type="center")
    ax.set(title="Held-out accuracy after RL (%)", ylim=(0, 105))
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{title}: mean and 95% interval over {n} seeds")
    fig.tight_layout()
    fig.savefig(out / "figure9.png", dpi=110)
    plt.close(fig)
    return [out / "figure4.png", out / "figure9.png"]
