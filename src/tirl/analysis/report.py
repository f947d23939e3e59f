"""`tirl analyze`: entropies under one or two models, the high-entropy token tables, a plot, a report.

With two models (before and after RL) both score the SAME trajectories, so a change in the shares
is a change of the policy, not of the sampled text.
"""

from __future__ import annotations

import json
from pathlib import Path

from tirl.analysis.entropy import (
    AnalysisError,
    AnalyzedTrajectory,
    load_model,
    read_trajectories,
    token_entropies,
)
from tirl.analysis.forking import KINDS, HighEntropyTokens, high_entropy_tokens


def analyze(
    trajectories: str | Path,
    models: list[str | Path],
    out: str | Path,
    top: float = 0.2,
    window: int = 16,
    limit: int | None = None,
    most_common: int = 20,
) -> dict:
    """Write OUT/report.md, OUT/analysis.json and OUT/entropy_trajectory.png; returns the analysis."""
    from tirl.engines.tokenizer import load_tokenizer
    from tirl.rl.checkpoint import resolve_model_path

    if not 0 < top <= 1:
        raise AnalysisError(f"--top {top}: give a share in (0, 1], e.g. 0.2 for the top 20%")
    if window < 1:
        raise AnalysisError(f"--window {window}: give at least 1 token")
    trajs = read_trajectories(trajectories, limit)
    try:  # a run or checkpoint directory means its newest model
        models = [resolve_model_path(str(m)) for m in models]
    except FileNotFoundError as e:
        raise AnalysisError(str(e)) from e
    tokenizer = load_tokenizer(models[0])
    entropies, results = {}, {}
    for n, path in enumerate(models):
        name = "model" if n == 0 else f"model{n + 1}"  # the CLI's --model / --model2
        entropies[name] = token_entropies(load_model(path), trajs)
        results[name] = high_entropy_tokens(
            entropies[name],
            [t.loss_mask for t in trajs],
            [t.response_ids for t in trajs],
            lambda i: tokenizer.decode([i]),
            top,
            window,
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shown = _example(trajs)
    plot = plot_entropy(
        trajs[shown], {n: e[shown] for n, e in entropies.items()}, results, out / "entropy_trajectory.png"
    )
    analysis = {
        "trajectories": str(trajectories),
        "count": len(trajs),
        "models": {name: str(path) for name, path in zip(results, models, strict=True)},
        "results": {name: r.to_dict(most_common) for name, r in results.items()},
        "plotted_trajectory": shown,
    }
    (out / "analysis.json").write_text(json.dumps(analysis, indent=2, ensure_ascii=False) + "\n")
    (out / "report.md").write_text(_markdown(analysis, results, plot, most_common))
    return analysis


def _example(trajs: list[AnalyzedTrajectory]) -> int:
    """The trajectory to plot: the one with the most tool responses (a correct one if possible)."""

    def segments(t: AnalyzedTrajectory) -> int:
        return sum(1 for a, b in zip(t.loss_mask, t.loss_mask[1:], strict=False) if a and not b)

    return max(range(len(trajs)), key=lambda i: (segments(trajs[i]), trajs[i].reward, -i))


def plot_entropy(
    traj: AnalyzedTrajectory, entropies: dict[str, list[float]], results: dict, path: Path
) -> Path:
    """Entropy along one trajectory's response; tool responses shaded, each model's threshold dashed."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.8))
    mask = traj.loss_mask
    start = None
    for i, m in enumerate([*mask, 1]):
        if not m and start is None:
            start = i
        elif m and start is not None:
            ax.axvspan(
                start, i, color="C2", alpha=0.2, label="tool response" if start == mask.index(0) else None
            )
            start = None
    for n, (name, ents) in enumerate(entropies.items()):
        ys = [e if m else float("nan") for e, m in zip(ents, mask, strict=True)]  # a gap at tool responses
        ax.plot(
            range(len(ys)), ys, ".-", color=f"C{n}", markersize=3, linewidth=0.8, label=f"entropy ({name})"
        )
        ax.axhline(
            results[name].threshold,
            color=f"C{n}",
            linestyle="--",
            linewidth=1,
            label=f"top {results[name].top:.0%} threshold ({name})",
        )
    ax.set(xlabel="response token", ylabel="entropy (nats)", title="Token entropy along a trajectory")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _markdown(analysis: dict, results: dict[str, HighEntropyTokens], plot: Path, most_common: int) -> str:
    names = list(results)
    lines = [
        "# High-entropy tokens: forking vs reflection",
        "",
        f"{analysis['count']} trajectories from `{analysis['trajectories']}`. A generated token is high-entropy "
        f"when it is in the top {results[names[0]].top:.0%} of all generated tokens by the model's entropy; it is "
        f"a reflection token when it is among the first {results[names[0]].window} generated tokens after a tool "
        "response, a forking token otherwise. Rate: the share of a kind's tokens that are high-entropy "
        f"({results[names[0]].top:.0%} everywhere would mean no pattern).",
        "",
        "| model | threshold (nats) | high-entropy forking | high-entropy reflection | reflection share | forking rate | reflection rate |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} (`{analysis['models'][name]}`) | {r.threshold:.3f} | {r.high['forking']} | {r.high['reflection']} "
            f"| {100 * r.share('reflection'):.1f}% | {100 * r.rate('forking'):.1f}% | {100 * r.rate('reflection'):.1f}% |"
        )
    if len(names) == 2:
        a, b = results[names[0]], results[names[1]]
        lines += [
            "",
            f"Reflection share of the high-entropy tokens: {100 * a.share('reflection'):.1f}% under {names[0]}, "
            f"{100 * b.share('reflection'):.1f}% under {names[1]} (same trajectories, two policies).",
        ]
    lines += ["", f"![entropy along a trajectory]({plot.name})", ""]
    for name, r in results.items():
        for kind in KINDS:
            total = r.high[kind]
            lines += [
                f"## Most frequent high-entropy {kind} tokens ({name})",
                "",
                "| token | count | share of kind |",
                "| --- | ---: | ---: |",
            ]
            for tok, count in r.tokens[kind].most_common(most_common):
                lines.append(
                    f"| `{tok.replace('|', '¦').replace(chr(10), '⏎')}` | {count} | {100 * count / total:.1f}% |"
                )
            lines.append("")
    return "\n".join(lines)
