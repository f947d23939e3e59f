"""Trainer throughput on a tiny model, and where the time of one RL step goes.

    .venv/bin/python benchmarks/train_throughput.py [--preset tiny|small] [--steps 3]

Part 1 times GRPO updates (old log-prob recomputation + clipped loss + backward + AdamW) on fixed
batches, as trained tokens per second, for several micro-batch budgets and with gradient
checkpointing, as RATIOS against the first row (same process, same batches: noise-robust).
Part 2 runs real RL steps (HF engine, sandbox, math-verify) and prints the time split per phase.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from tirl.config import dump_config
from tirl.data import write_problems
from tirl.demo.synthetic import generate
from tirl.distributed.groups import init_distributed
from tirl.rl.config import AlgorithmConfig, OptimConfig, TrainConfig
from tirl.rl.metrics import read_metrics
from tirl.rl.policy import Policy, TrainSample
from tirl.rl.trainer import run_training
from tirl.rl.update import grpo_update
from tirl.tiny_model import create_tiny_model


def fixed_batch(vocab: int, n: int, prompt: int, response: int, seed: int = 0) -> list[TrainSample]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(response // 2, response + 1))
        ids = rng.integers(10, vocab, prompt + length).tolist()
        out.append(TrainSample(ids, [0] * (prompt - 1) + [1] * length, float(rng.normal())))
    return out


def update_throughput(model_dir: Path, rounds: int) -> list[tuple[str, float]]:
    """Median trained tokens/s per variant; variants take turns each round, so load drift hits all alike."""
    info = init_distributed("cpu")
    base = {"device": "cpu", "warmup_steps": 0}
    variants = {
        "micro 4096 tok": OptimConfig(micro_batch_tokens=4096, **base),
        "micro 1024 tok": OptimConfig(micro_batch_tokens=1024, **base),
        "micro 16384 tok": OptimConfig(micro_batch_tokens=16384, **base),
        "micro 4096 + grad ckpt": OptimConfig(micro_batch_tokens=4096, gradient_checkpointing=True, **base),
    }
    policies = {
        name: Policy(str(model_dir), optim, info, total_steps=rounds + 1) for name, optim in variants.items()
    }
    vocab = next(iter(policies.values())).model.config.vocab_size
    batch = fixed_batch(vocab, 16, 64, 192)
    speeds: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds + 1):
        for name, policy in policies.items():
            start = time.perf_counter()
            tokens = grpo_update(policy, batch, AlgorithmConfig())["train/trained_tokens"]
            if r:  # round 0 warms up
                speeds[name].append(tokens / (time.perf_counter() - start))
    return [(name, statistics.median(v)) for name, v in speeds.items()]


def rl_step_split(model_dir: Path, work: Path, steps: int) -> dict[str, float]:
    data = work / "problems.jsonl"
    write_problems(data, generate(64, seed=0))
    cfg = TrainConfig(
        model=str(model_dir),
        output_dir=str(work / "runs"),
        run_name="bench",
        engine={"backend": "hf", "device": "cpu", "max_model_len": 1024, "max_batch_size": 64},
        agent={"max_turns": 3, "max_response_tokens": 96},
        sandbox={"mode": "inprocess"},
        reward={"workers": 1},
        algorithm={"prompts_per_step": 4, "group_size": 4},
        optim={"lr": 1e-4, "warmup_steps": 0, "device": "cpu"},
        stages=[{"name": "bench", "steps": steps + 1, "data": str(data)}],
        checkpoint={"every": 1000},
        logging={"tensorboard": False},
    )
    dump_config(cfg, work / "bench.yaml")
    rows = read_metrics(run_training(cfg, progress=False))[1:]  # step 1 includes warm-up
    keys = sorted({k for r in rows for k in r if k.startswith("time/") and k.endswith("_s")})
    split = {k: statistics.mean(r.get(k, 0.0) for r in rows) for k in keys}
    split["perf/rollout_tokens_per_s"] = statistics.mean(r["perf/rollout_tokens_per_s"] for r in rows)
    split["perf/train_tokens_per_s"] = statistics.mean(r["perf/train_tokens_per_s"] for r in rows)
    split["tool_wait_share"] = statistics.mean(r["time/tool_wait_share"] for r in rows)
    return split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rounds", type=int, default=3, help="timed updates per variant")
    parser.add_argument("--steps", type=int, default=3, help="timed RL steps")
    args = parser.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = create_tiny_model(work / "model", preset=args.preset)

        results = update_throughput(model_dir, args.rounds)
        title = (
            f"GRPO update throughput ({args.preset} model, 16 x <=256 tokens, CPU, median of {args.rounds})"
        )
        table = Table(title=title)
        for col in ("variant", "trained tokens/s", "ratio"):
            table.add_column(col)
        for name, tps in results:
            table.add_row(name, f"{tps:,.0f}", f"{tps / results[0][1]:.2f}x")
        console.print(table)

        split = rl_step_split(model_dir, work, args.steps)
        step = split.pop("time/step_s")
        table = Table(title=f"RL step time split (mean of {args.steps} steps, 4 prompts x 8 rollouts)")
        for col in ("phase", "seconds", "share of step"):
            table.add_column(col)
        for key in sorted(k for k in split if k.startswith("time/")):
            table.add_row(
                key.removeprefix("time/").removesuffix("_s"), f"{split[key]:.2f}", f"{split[key] / step:.0%}"
            )
        table.add_row("step (total)", f"{step:.2f}", "100%")
        console.print(table)
        console.print(
            f"rollout {split['perf/rollout_tokens_per_s']:,.0f} generated tok/s, "
            f"train {split['perf/train_tokens_per_s']:,.0f} trained tok/s, "
            f"tool wait {split['tool_wait_share']:.0%} of trajectory time"
        )


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # its engines, sandboxes and workers die with it, even on kill -9
    main()
