"""Held-out accuracy of a model with the demo's own evaluation (the one `tirl demo` reports before and
after RL: its eval.yaml settings, engine and sandbox, on the demo's held-out problems).

    .venv/bin/python examples/openai_agent/heldout.py --demo runs/demo --model runs/openai_agent --out runs/openai_agent/eval

Prints pass@1 (%) and writes the evaluation report to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from tirl.data.loaders import load_problems
from tirl.demo.pipeline import _eval_numbers, _evaluate, load_settings
from tirl.rl.checkpoint import resolve_model_path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--demo", required=True, help="the output directory of `tirl demo` (its data/heldout.jsonl)"
    )
    p.add_argument("--model", required=True, help="model, checkpoint or tirl run directory")
    p.add_argument("--out", required=True, help="where the evaluation report goes")
    p.add_argument("--limit", type=int, default=None, help="only the first N held-out problems")
    args = p.parse_args(argv)
    settings = load_settings()  # the demo's configs, as `tirl demo` ran them by default
    problems = load_problems(Path(args.demo) / "data" / "heldout.jsonl", limit=args.limit)
    model = Path(resolve_model_path(args.model))
    report = asyncio.run(_evaluate(settings, model, problems, Path(args.out), progress=False))
    numbers = {"model": str(model), **_eval_numbers(report)}
    print(json.dumps(numbers), flush=True)
    return numbers


if __name__ == "__main__":
    main()
