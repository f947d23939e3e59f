"""GSM8K test problems with the Python tool, for the real model's three stages (docs/real-model.md).

From one finished `tirl demo --real` directory: the pretrained model as it is, the SFT model and the
GRPO-RoC model, each through `tirl eval` with the demo's agent settings on the first N problems of a
GSM8K test file the user gives (no dataset download), with a 95% Wilson interval on each accuracy.

    .venv/bin/python benchmarks/real_model_gsm8k.py --demo runs/real --data PATH/TO/gsm8k_test.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / "src" / "tirl" / "configs" / "demo" / "agent.yaml"


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion (sound near 0 and 1, where the normal one is not)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def models_of(demo: Path) -> dict[str, Path]:
    """base -> the pretrained directory, sft/rl -> the runs' newest checkpoints."""
    from tirl.rl.checkpoint import latest_model_dir

    settings = json.loads((demo / "settings.json").read_text())
    base = settings["demo"]["model"]
    if base is None:
        raise SystemExit(f"{demo} is a tiny-model demo: give a `tirl demo --real` directory")
    return {"base": Path(base), "sft": latest_model_dir(demo / "sft"), "rl": latest_model_dir(demo / "rl")}


def evaluate(name: str, model: Path, args: argparse.Namespace) -> dict:
    out = args.out / name
    command = [
        str(ROOT / ".venv" / "bin" / "tirl"), "eval", "--model", str(model), "--data", str(args.data),
        "--limit", str(args.limit), "--samples", "1", "--engine", args.engine, "--out", str(out),
        "--max-tokens", str(args.max_tokens), "--agent", str(AGENT), "--seed", str(args.seed),
    ]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(command, check=True)
    seconds = time.perf_counter() - start
    metrics = json.loads((out / "metrics.json").read_text())
    [bench] = metrics["benchmarks"].values()
    low, high = wilson(bench["pass1"] * bench["problems"], bench["problems"])
    return {"model": name, "accuracy": bench["pass1"], "low": low, "high": high, "seconds": round(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", type=Path, default=Path("runs/real"))
    parser.add_argument("--data", type=Path, required=True, help="a GSM8K test .jsonl (id, problem, answer)")
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--engine", default="vllm")
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=Path("runs/real_gsm8k"))
    args = parser.parse_args()
    if not args.data.is_file():
        sys.exit(f"{args.data}: no such file (GSM8K's test split as .jsonl; tirl downloads no dataset)")
    rows = [evaluate(name, model, args) for name, model in models_of(args.demo).items()]
    print(f"GSM8K, first {args.limit} test problems, 1 sample each, with the tool ({args.engine} engine):")
    print("| model | accuracy % | 95% interval | eval s |\n| --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['model']} | {100 * r['accuracy']:.1f} | [{100 * r['low']:.1f}, {100 * r['high']:.1f}] | {r['seconds']} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # its engines and evaluations die with it, even on kill -9
    main()
