"""The tiny demo's GRPO-RoC, synchronous vs asynchronous, side by side: RL wall time, trainer and engine
idle fractions, and held-out accuracy, from the SFT model and data of a finished `tirl demo` directory
(same SFT model, data, seed, step budget and evaluation; only `algorithm.async` differs).

    .venv/bin/python benchmarks/async_demo.py --demo runs/demo [--k 1] [--out runs/async_demo]

Each run is a full `tirl train` of the demo config (demo.rl_steps steps) plus the demo's held-out
evaluation: tens of minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from statistics import mean

from tirl.data import load_problems
from tirl.demo.pipeline import _evaluate, load_settings, train_config
from tirl.rl.checkpoint import latest_model_dir
from tirl.rl.trainer import run_training


def run(settings, demo: Path, out: Path, name: str, staleness: int | None, tis_cap: float | None) -> dict:
    """One RL run (async with `staleness` k, or synchronous for None) and its held-out evaluation."""
    cfg = train_config(
        settings, latest_model_dir(demo / "sft"), str(demo / "data" / "rl_train.jsonl"), out, name
    )
    cfg.algorithm = cfg.algorithm.model_copy(update={"tis_cap": tis_cap})
    if staleness is not None:
        cfg.algorithm = cfg.algorithm.model_copy(update={"async_": True, "max_staleness": staleness})
    start = time.perf_counter()
    run_dir = run_training(cfg, progress=False)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    heldout = load_problems(str(demo / "data" / "heldout.jsonl"))
    report = asyncio.run(_evaluate(settings, latest_model_dir(run_dir), heldout, out / f"eval_{name}", False))
    return {
        "run": name,
        "rl_wall_s": wall,
        "step_s": mean(r["time/step_s"] for r in rows),
        "trainer_idle": mean(r["perf/trainer_idle_frac"] for r in rows),
        "engine_idle": mean(r["perf/engine_idle_frac"] for r in rows),
        "dropped_stale": sum(r.get("async/dropped_stale", 0) for r in rows),
        "reward_last5": mean(r["reward/mean"] for r in rows[-5:]),
        "heldout_accuracy": 100 * report.benchmarks["heldout"].metrics.pass1,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", required=True, help="a finished `tirl demo` output directory")
    ap.add_argument("--out", default="runs/async_demo")
    ap.add_argument("--k", type=int, default=1, help="algorithm.max_staleness of the async run")
    ap.add_argument("--only", choices=["sync", "async"], help="run one side only")
    ap.add_argument("--tis-cap", type=float, help="algorithm.tis_cap of both runs (default: off)")
    ap.add_argument("overrides", nargs="*", help="demo settings, e.g. demo.rl_steps=10")
    args = ap.parse_args()
    demo, out = Path(args.demo), Path(args.out)
    if not (demo / "sft").is_dir() or not (demo / "data" / "heldout.jsonl").is_file():
        raise SystemExit(f"{demo} is not a finished `tirl demo` directory (no sft/ or data/heldout.jsonl)")
    settings = load_settings(overrides=args.overrides)
    sides = [("sync", None), (f"async_k{args.k}", args.k)]
    results = [
        run(settings, demo, out, n, k, args.tis_cap) for n, k in sides if args.only in (None, n.split("_")[0])
    ]
    (out / "async_demo.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'run':<10} {'RL wall s':>10} {'step s':>8} {'trainer idle':>13} {'engine idle':>12} "
          f"{'dropped':>8} {'reward (last 5)':>16} {'held-out acc':>13}")  # fmt: skip
    for r in results:
        print(
            f"{r['run']:<10} {r['rl_wall_s']:>10.0f} {r['step_s']:>8.1f} {r['trainer_idle']:>13.1%} "
            f"{r['engine_idle']:>12.1%} {r['dropped_stale']:>8} {r['reward_last5']:>16.3f} "
            f"{r['heldout_accuracy']:>12.1f}%"
        )
    if len(results) == 2:
        print(f"async / sync RL wall time: {results[1]['rl_wall_s'] / results[0]['rl_wall_s']:.2f}x")


if __name__ == "__main__":
    main()
