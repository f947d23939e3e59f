"""Copy-drill SFT steps with torch's OpenMP workers spinning (libgomp's default) vs sleeping while
they wait (OMP_WAIT_POLICY=PASSIVE, what `import tirl` sets), side by side, alternating.

    .venv/bin/python benchmarks/omp_wait.py [--steps 15] [--rounds 2] [--load 2]

Each variant runs in a fresh subprocess (the policy is read once, when torch loads its OpenMP runtime)
and times `--steps` drill steps of the demo preset (tirl demo's stage 0a). `--load N` adds N busy
processes for the duration, standing in for the other jobs of a shared machine. Prints seconds per
step and the ratio spinning / sleeping per round.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

CHILD = """
import sys, time, torch
from pathlib import Path
from tirl.demo.pipeline import load_settings, _sft
from tirl.demo.sft_traces import copy_drills, write_traces
from tirl.tiny_model import create_tiny_model
out, steps = Path(sys.argv[1]), int(sys.argv[2])
s = load_settings(overrides=[f"demo.drill_steps={steps}"])
model = create_tiny_model(out / "init", preset="demo", seed=0)
data = write_traces(copy_drills(steps * int(s.drills["batch_size"]), 1), out / "drills.jsonl")
start = time.perf_counter()
_sft(s.drills | {"epochs": 1}, s, model, data, out, False)
print(f"RESULT {(time.perf_counter() - start) / steps:.4f}")
"""


def run(policy: str, steps: int) -> float:
    env = dict(os.environ, OMP_WAIT_POLICY=policy)  # tirl's setdefault keeps what is set here
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, tmp, str(steps)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return float(next(ln for ln in out.splitlines() if ln.startswith("RESULT")).split()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--load", type=int, default=0, help="busy processes to run alongside")
    args = ap.parse_args()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        print(f"loadavg {os.getloadavg()[0]:.1f}, {os.cpu_count()} cpus, {args.load} busy processes added")
        print("round | spin s/step | sleep s/step | spin / sleep")
        for r in range(1, args.rounds + 1):
            spin, sleep = run("ACTIVE", args.steps), run("PASSIVE", args.steps)
            print(f"{r} | {spin:.3f} | {sleep:.3f} | {spin / sleep:.2f}x")
    finally:
        for h in hogs:
            h.kill()


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # its engines, sandboxes and workers die with it, even on kill -9
    main()
