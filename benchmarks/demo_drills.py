"""What the copy skill's phase change depends on: `tirl demo`'s drill stage alone, in fresh processes.

    .venv/bin/python benchmarks/demo_drills.py --cap 500 \
        --variant seed0:demo.seed=0 --variant seed1:demo.seed=1 \
        --variant seed0-1thread:demo.seed=0,OMP_NUM_THREADS=1 --variant lr2e-3:drills.optim.lr=2e-3

Each variant (a SETTING is an environment variable, upper case, or a demo override, as in
benchmarks/demo_phases.py) runs the demo's drills (tirl.demo.drills) from a fresh model of its seed
until it copies every held-out drill (target 100%) or --cap, checking held-out copy accuracy every
--check-every steps, and prints that curve and the first step at which 95% of held-out drills are
copied exactly (the demo's default target). The variants run one after another (or --parallel 2).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

CHILD = r"""
import json, sys, time
from pathlib import Path
from tirl.demo import pipeline as p
from tirl.demo.drills import StopRule

out, cap, every, overrides = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
s = p.load_settings(overrides=overrides + [f"demo.drill_steps={cap}"])
model = p._create_model(s.demo, out)
start = time.perf_counter()
rule = StopRule(max_steps=cap, check_every=every, target=1.0, heldout=s.demo.drill_heldout)
outcome = p._run_drills(s, model, out, rule, lambda line: None)
print("RESULT " + json.dumps({"seconds": time.perf_counter() - start, "history": outcome.history}))
"""


def parse_variant(text: str) -> tuple[str, dict[str, str], list[str]]:
    """NAME[:A=B,c.d=e] -> (name, environment, demo overrides)."""
    name, _, rest = text.partition(":")
    env, overrides = {}, []
    for item in filter(None, rest.split(",")):
        key, eq, _ = item.partition("=")
        if not eq:
            raise SystemExit(f"--variant {text!r}: {item!r} is not KEY=VALUE")
        if key.isupper():
            env[key] = item.partition("=")[2]
        else:
            overrides.append(item)
    return name, env, overrides


def run(cap: int, every: int, env: dict[str, str], overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, tmp, str(cap), str(every), json.dumps(overrides)],
            env=dict(os.environ, **env),
            capture_output=True,
            text=True,
        )
    if proc.returncode:
        raise SystemExit(f"drills failed ({env} {overrides}):\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT ") :])


def first_step(history: list[dict], target: float) -> int | None:
    return next((h["step"] for h in history if h["copy_accuracy"] >= target), None)


def report(name: str, result: dict, load: tuple[float, float]) -> str:
    h = result["history"]
    curve = " ".join(f"{r['step']}:{r['copy_accuracy']:.2f}/{r['loss']:.3f}" for r in h)
    return (
        f"{name}: 95% copied at step {first_step(h, 0.95)}, 50% at {first_step(h, 0.5)}; "
        f"{result['seconds']:.0f} s ({result['seconds'] / h[-1]['step']:.2f} s/step), loadavg "
        f"{load[0]:.1f}->{load[1]:.1f}\n  step:accuracy/loss {curve}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap", type=int, default=500, help="drill steps per run")
    ap.add_argument("--check-every", type=int, default=25)
    ap.add_argument("--parallel", type=int, default=1, help="variants run at once")
    ap.add_argument("--variant", action="append", required=True, help="NAME[:SETTING,...]")
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    print(
        f"drills: cap {args.cap} steps, loadavg {os.getloadavg()[0]:.1f}, {os.cpu_count()} cpus", flush=True
    )

    def one(variant: tuple[str, dict[str, str], list[str]]) -> str:
        name, env, overrides = variant
        before = os.getloadavg()[0]
        result = run(args.cap, args.check_every, env, overrides)
        line = report(name, result, (before, os.getloadavg()[0]))
        print(line, flush=True)
        return line

    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(one, variants))


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()
    main()
