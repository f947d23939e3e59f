"""One phase of `tirl demo` under several settings, side by side, alternating, in fresh processes.

    .venv/bin/python benchmarks/demo_phases.py PHASE [--steps N] [--rounds R] [--model DIR]
        --variant NAME[:SETTING,SETTING...] --variant ...

PHASE is one of traces (SFT traces for N problems), drills (N copy-drill steps), sft (N trace SFT
steps), rl (N GRPO-RoC steps) or eval (N held-out problems x the eval samples). A SETTING is either an
environment variable (`OMP_NUM_THREADS=1`, upper case) or a demo override (`sft.optim.micro_batch_tokens=4096`).
rl and eval need `--model` (a demo run's `sft` directory: an untrained model's rollouts would all
run to the length budget); sft starts from it when given, else from a fresh model (same step cost). Each round runs every variant once, in order, each in a fresh process (the
OpenMP runtime reads its settings when torch loads), so load drift on a shared machine hits all alike.
Prints wall and CPU seconds (the whole process tree: engine, sandbox, reward workers) per unit (step,
problem) per run, and each variant's ratios to the first one. On a loaded machine the CPU seconds are
the steadier measure of the work a setting saves; the wall time on idle cores is what users see.

Example (the thread count of SFT steps on 2 cores):
    .venv/bin/python benchmarks/demo_phases.py sft --model runs/demo/sft --steps 20 \
        --variant two-threads --variant one-thread:OMP_NUM_THREADS=1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import asyncio, json, resource, sys, time
from pathlib import Path
import tirl
from tirl.demo import pipeline as p

phase, out, steps, model, overrides = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5])
s = p.load_settings(overrides=overrides)
demo = s.demo.model_copy(update={"sft_problems": max(steps, 1), "rl_problems": 200, "heldout_problems": max(steps, 1)})
sft_problems, rl_data, heldout = p._make_problems(demo, out)
def cpu():  # this process and every process it started and waited for (engine, sandbox, reward pool)
    return sum(resource.getrusage(w).ru_utime + resource.getrusage(w).ru_stime
               for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
start, cpu0 = time.perf_counter(), cpu()
if phase == "traces":
    asyncio.run(p._make_traces(s, sft_problems, out))
elif phase == "drills":
    s.demo = s.demo.model_copy(update={"drill_steps": steps})
    p._drill(s, p._create_model(s.demo, out), out, False, False)
elif phase == "sft":
    s.demo = s.demo.model_copy(update={"sft_problems": steps * int(s.sft.get("batch_size", 16))})
    problems, _, _ = p._make_problems(s.demo, out)
    asyncio.run(p._make_traces(s, problems, out))
    start = time.perf_counter()
    start_model = Path(model) if model else p._create_model(s.demo, out)
    p._sft(s.sft | {"epochs": 1}, s, start_model, out / "data" / "sft_traces.jsonl", out, False, False)
elif phase == "rl":
    s.demo = s.demo.model_copy(update={"rl_steps": steps})
    with p.SharedRuntime(p.train_config(s, Path(model), rl_data, out, "rl")) as shared:  # opened by the run
        p._train(s, Path(model), rl_data, out, "rl", None, False, s.demo.seed, False, shared)
elif phase == "eval":
    asyncio.run(p._evaluate(s, Path(model), heldout, out / "eval", False))
else:
    raise SystemExit(f"unknown phase {phase!r}")
n = max(steps, 1)
print(f"RESULT {(time.perf_counter() - start) / n:.4f} {(cpu() - cpu0) / n:.4f}")
"""

PHASES = ("traces", "drills", "sft", "rl", "eval")


def parse_variant(text: str) -> tuple[str, dict[str, str], list[str]]:
    """NAME[:A=B,c.d=e] -> (name, environment, demo overrides)."""
    name, _, rest = text.partition(":")
    env, overrides = {}, []
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"--variant {text!r}: {item!r} is not KEY=VALUE")
        if key.isupper():
            env[key] = value
        else:
            overrides.append(item)
    return name, env, overrides


def run(phase: str, steps: int, model: str, env: dict[str, str], overrides: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the whole process tree) per unit of one fresh run."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, phase, tmp, str(steps), model, json.dumps(overrides)],
            env=dict(os.environ, **env),
            capture_output=True,
            text=True,
        )
    if proc.returncode:
        raise SystemExit(f"{phase} run failed ({env} {overrides}):\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    wall, cpu = map(float, line.split()[1:])
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=PHASES)
    ap.add_argument(
        "--steps", type=int, default=10, help="steps (drills, sft, rl) or problems (traces, eval)"
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="", help="the model sft, rl and eval start from (a demo's sft dir)")
    ap.add_argument("--variant", action="append", required=True, help="NAME[:SETTING,...]")
    args = ap.parse_args()
    if args.phase in ("rl", "eval") and not Path(args.model).exists():
        raise SystemExit(f"{args.phase} needs --model: a demo run's sft directory (e.g. runs/demo/sft)")
    variants = [parse_variant(v) for v in args.variant]
    wall: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    unit = "problem" if args.phase in ("traces", "eval") else "step"
    print(
        f"{args.phase}: {args.steps} {unit}s per run, loadavg {os.getloadavg()[0]:.1f}, {os.cpu_count()} cpus"
    )
    for r in range(1, args.rounds + 1):
        for name, env, overrides in variants:
            w, c = run(args.phase, args.steps, args.model, env, overrides)
            wall[name].append(w)
            cpu[name].append(c)
            print(
                f"round {r} {name}: wall {w:.3f} s/{unit}, cpu {c:.3f} s/{unit} (loadavg {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    base = variants[0][0]
    print(f"ratios {base} / variant, per round (> 1: the variant is faster or cheaper)")
    for name in wall:
        w = " ".join(f"{b / x:.2f}x" for b, x in zip(wall[base], wall[name], strict=True))
        c = " ".join(f"{b / x:.2f}x" for b, x in zip(cpu[base], cpu[name], strict=True))
        print(
            f"{name}: median wall {statistics.median(wall[name]):.3f}, cpu {statistics.median(cpu[name]):.3f} "
            f"s/{unit}; wall {w}; cpu {c}"
        )


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # its engines, sandboxes and workers die with it, even on kill -9
    main()
