"""The tiny demo's GRPO-RoC, synchronous vs asynchronous, side by side: RL wall time, trainer and engine
idle fractions, the off-policy guard-rail signals, and held-out accuracy, from the SFT model and data of
a finished `tirl demo` directory (same SFT model, data, seed, step budget and evaluation; only the
`algorithm` settings below differ).

    .venv/bin/python benchmarks/async_demo.py --demo runs/demo [--k 1] [--tis-cap off] \
        [--staleness-mode exact] [--only async] [--out runs/async_demo] [demo.seed=1 ...]
    .venv/bin/python benchmarks/async_demo.py --demo runs/demo --seeds 5    # seeds 0-4, both sides
    .venv/bin/python benchmarks/async_demo.py --demo runs/demo --seeds 5 --hog 2  # beside a CPU-heavy job
    .venv/bin/python benchmarks/async_demo.py --out OUT --curves sync=RUN_DIR exact=RUN_DIR  # OUT/curves.png

With `--seeds N` both sides run for seeds 0..N-1 (a run whose OUT/<run>.json exists is not run again, so
an interrupted comparison continues; `--first-seed` splits the seeds between calls run at once), then
OUT/seeds.json holds each quantity's mean and 95% interval
per side and the paired difference async - sync (same seed = same prompts), and OUT/figure9.png the
per-step bands and held-out accuracy.

The async run gets tirl's defaults for async (truncated importance sampling, cap 2.0) unless `--tis-cap`
says otherwise (`off`: no correction, the configuration that collapsed). Each run is a full `tirl train`
of the demo config (demo.rl_steps steps) plus the demo's held-out evaluation: tens of minutes on a
2-core CPU. Results: OUT/<run>.json each, OUT/async_demo.json for the runs of one call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import mean

from tirl.data import load_problems
from tirl.demo.pipeline import DemoSettings, _evaluate, load_settings, train_config
from tirl.rl.checkpoint import latest_model_dir
from tirl.rl.trainer import run_training


def _max(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return max(values) if values else None


def _guard_rails(rows: list[dict]) -> dict:
    """What the off-policy alerts watch, at its worst over the run, and the first alerting step."""
    alerting = [r["step"] for r in rows if r.get("alerts")]
    return {
        "engine_gap_max": _max(rows, "train/engine_logprob_gap"),
        "length_share_max": _max(rows, "finish/length") or 0.0,
        "approx_kl_max": _max(rows, "train/approx_kl"),
        "tis_truncated_max": _max(rows, "train/tis_truncated_frac"),
        "first_alert_step": alerting[0] if alerting else None,
    }


# A busy loop that dies with the benchmark even when that is killed -9 (PR_SET_PDEATHSIG = 1, SIGKILL),
# and at once if it was already gone before the hog could ask.
HOG = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, 9)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit()\n"
    "while True: pass\n"
)


@contextmanager
def cpu_hog(processes: int) -> Iterator[None]:
    """A CPU-heavy job beside the runs at their own priority: `processes` single-core busy loops, each
    one process's worth of a compile or a test suite, killed when the block ends."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG, str(os.getpid())]) for _ in range(processes)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def run(settings: DemoSettings, demo: Path, out: Path, name: str) -> dict:
    """One RL run with `settings` and its held-out evaluation."""
    cfg = train_config(
        settings, latest_model_dir(demo / "sft"), str(demo / "data" / "rl_train.jsonl"), out, name
    )
    alg = cfg.algorithm
    start = time.perf_counter()
    run_dir = run_training(cfg, progress=False)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    heldout = load_problems(str(demo / "data" / "heldout.jsonl"))
    report = asyncio.run(_evaluate(settings, latest_model_dir(run_dir), heldout, out / f"eval_{name}", False))
    result = {
        "run": name,
        "run_dir": str(run_dir),
        "seed": cfg.seed,
        "async": alg.async_,
        "max_staleness": alg.staleness_bound,
        "staleness_mode": alg.staleness_mode if alg.async_ else None,
        "tis_cap": alg.tis_cap,
        "rl_wall_s": wall,
        "step_s": mean(r["time/step_s"] for r in rows),
        "trainer_idle": mean(r["perf/trainer_idle_frac"] for r in rows),
        "engine_idle": mean(r["perf/engine_idle_frac"] for r in rows),
        "dropped_stale": sum(r.get("async/dropped_stale", 0) for r in rows),
        "reward_last5": mean(r["reward/mean"] for r in rows[-5:]),
        "reward_curve": [round(r["reward/mean"], 4) for r in rows],
        "heldout_accuracy": 100 * report.benchmarks["heldout"].metrics.pass1,
    } | _guard_rails(rows)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def run_or_load(settings: DemoSettings, demo: Path, out: Path, name: str) -> dict:
    """`run`, unless OUT/<name>.json says it already ran."""
    done = out / f"{name}.json"
    return json.loads(done.read_text()) if done.is_file() else run(settings, demo, out, name)


def compare_seeds(results: dict[str, list[dict]], out: Path) -> dict:
    """Mean and 95% interval over seeds per side, and the paired difference of async minus sync."""
    from tirl.demo.plots import plot_comparison
    from tirl.demo.seed_stats import summarize
    from tirl.rl.metrics import read_metrics

    training = {side: [read_metrics(Path(r["run_dir"])) for r in rows] for side, rows in results.items()}
    # async first everywhere: the differences are async - sync, and each side keeps one colour per figure
    order = ("async", "sync")
    accuracy = {side: [r["heldout_accuracy"] for r in results[side]] for side in order}
    summary = summarize({side: training[side] for side in order}, accuracy)
    summary["rl_wall_s"] = {side: [round(r["rl_wall_s"]) for r in rows] for side, rows in results.items()}
    (out / "seeds.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_comparison(summary, out, title="Asynchronous (k=1, TIS 2.0) vs synchronous GRPO-RoC")
    return summary


# The curves figure: how a run learns, and the off-policy signals that moved when async collapsed.
CURVES = (
    ("reward/mean", "Reward (training rollouts)", 1.0),
    ("response/length_mean", "Response length (tokens)", 1.0),
    ("train/engine_logprob_gap", "Engine vs trainer log-prob gap (nats/token)", 1.0),
    ("finish/length", "Rollouts ending at the length limit (%)", 100.0),
)


def plot_runs(runs: dict[str, Path], path: Path) -> Path:
    """Each run's CURVES, step by step and unsmoothed (an exact-mode run repeats them exactly), as one
    2 x 2 figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tirl.rl.metrics import read_metrics

    rows = {name: read_metrics(run_dir) for name, run_dir in runs.items()}
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5))
    for ax, (key, title, scale) in zip(axes.flat, CURVES, strict=True):
        for name, metrics in rows.items():
            points = [(r["step"], scale * r[key]) for r in metrics if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker=".", linewidth=1.2, label=name)
        ax.set(title=title, xlabel="RL step")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _named_runs(items: list[str]) -> dict[str, Path]:
    runs = {}
    for item in items:
        name, eq, run_dir = item.rpartition("=")  # a name may hold "=" (k=1), a run path rarely does
        if not eq or not (Path(run_dir) / "metrics.jsonl").is_file():
            raise SystemExit(f"--curves {item!r}: give NAME=RUN_DIR, a run directory with metrics.jsonl")
        runs[name] = Path(run_dir)
    return runs


def _print_seeds(summary: dict) -> None:
    acc = summary["heldout_accuracy"]
    for side in ("sync", "async", "difference"):
        iv = acc[side]
        per_seed = ", ".join(f"{a:.1f}" for a in acc[side].get("per_seed", []))
        print(f"held-out {side:<10} {iv['mean']:6.2f} [{iv['low']:6.2f}, {iv['high']:6.2f}]  {per_seed}")


def _async_overrides(args: argparse.Namespace) -> list[str]:
    extra = ["train.algorithm.async=true", f"train.algorithm.max_staleness={args.k}"]
    extra.append(f"train.algorithm.staleness_mode={args.staleness_mode}")
    if args.tis_cap is not None:  # else tirl's default for async
        extra.append(f"train.algorithm.tis_cap={'null' if args.tis_cap == 'off' else float(args.tis_cap)}")
    return extra


def _print(results: list[dict]) -> None:
    print(
        f"{'run':<24} {'seed':>4} {'RL wall s':>10} {'step s':>7} {'trainer idle':>13} {'engine idle':>12} "
        f"{'dropped':>8} {'reward (last 5)':>16} {'gap max':>8} {'length max':>11} {'held-out':>9}"
    )
    for r in results:
        gap = "n/a" if r["engine_gap_max"] is None else f"{r['engine_gap_max']:.3f}"
        print(
            f"{r['run']:<24} {r['seed']:>4} {r['rl_wall_s']:>10.0f} {r['step_s']:>7.1f} {r['trainer_idle']:>13.1%} "
            f"{r['engine_idle']:>12.1%} {r['dropped_stale']:>8} {r['reward_last5']:>16.3f} {gap:>8} "
            f"{r['length_share_max']:>11.0%} {r['heldout_accuracy']:>8.1f}%"
        )


def _sides(args: argparse.Namespace, seed: int) -> dict[str, tuple[str, DemoSettings]]:
    """Run name and settings of each side for `seed`."""
    overrides = [*args.overrides, f"demo.seed={seed}"]  # the last one wins
    exact = "_exact" if args.staleness_mode == "exact" else ""
    tis = "" if args.tis_cap is None else f"_tis{args.tis_cap}"
    return {
        "sync": (f"sync_seed{seed}", load_settings(overrides=overrides)),
        "async": (
            args.name or f"async_k{args.k}{exact}{tis}_seed{seed}",
            load_settings(overrides=[*overrides, *_async_overrides(args)]),
        ),
    }


def _main_seeds(args: argparse.Namespace, demo: Path, out: Path) -> None:
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    for seed in range(args.first_seed, args.seeds):
        for side, (name, settings) in _sides(args, seed).items():
            results[side].append(run_or_load(settings, demo, out, name))
    _print([r for pair in zip(results["sync"], results["async"], strict=True) for r in pair])
    _print_seeds(compare_seeds(results, out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", help="a finished `tirl demo` output directory (required unless --curves)")
    ap.add_argument("--out", default="runs/async_demo")
    ap.add_argument("--k", type=int, default=1, help="algorithm.max_staleness of the async run")
    ap.add_argument("--only", choices=["sync", "async"], help="run one side only")
    ap.add_argument(
        "--tis-cap", help="algorithm.tis_cap of the async run: a number, or off (default: tirl's)"
    )
    ap.add_argument("--staleness-mode", choices=["bounded", "exact"], default="bounded")
    ap.add_argument("--seeds", type=int, help="run both sides for seeds 0..N-1 and compare them")
    ap.add_argument(
        "--first-seed",
        type=int,
        default=0,
        help="with --seeds: start at this seed (share seeds between calls)",
    )
    ap.add_argument("--hog", type=int, default=0, help="busy processes beside the runs (a CPU-heavy job)")
    ap.add_argument("--name", help="the async run's name (default async_k<k>[_exact][_tis<cap>]_seed<seed>)")
    ap.add_argument(
        "--curves", nargs="+", metavar="NAME=RUN_DIR", help="only plot these finished runs to OUT/curves.png"
    )
    ap.add_argument("overrides", nargs="*", help="demo settings, e.g. demo.rl_steps=10 demo.seed=1")
    args = ap.parse_args()
    if args.curves:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        print(plot_runs(_named_runs(args.curves), Path(args.out) / "curves.png"))
        return
    if not args.demo:
        raise SystemExit("--demo is required (a finished `tirl demo` output directory)")
    demo, out = Path(args.demo), Path(args.out)
    if not (demo / "sft").is_dir() or not (demo / "data" / "heldout.jsonl").is_file():
        raise SystemExit(f"{demo} is not a finished `tirl demo` directory (no sft/ or data/heldout.jsonl)")
    out.mkdir(parents=True, exist_ok=True)
    with cpu_hog(args.hog):
        _main(args, demo, out)


def _main(args: argparse.Namespace, demo: Path, out: Path) -> None:
    if args.seeds:
        return _main_seeds(args, demo, out)
    seed = load_settings(overrides=args.overrides).demo.seed
    sides = _sides(args, seed)
    results = [run(s, demo, out, name) for side, (name, s) in sides.items() if args.only in (None, side)]
    (out / "async_demo.json").write_text(json.dumps(results, indent=2) + "\n")
    _print(results)
    if len(results) == 2:
        print(f"async / sync RL wall time: {results[1]['rl_wall_s'] / results[0]['rl_wall_s']:.2f}x")


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # its engines, sandboxes and workers die with it, even on kill -9
    main()
