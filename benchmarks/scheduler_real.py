"""Dynamic (KV-cache-aware) vs static rollout scheduling on two real vLLM engines (tiny model, CPU).

    .venv/bin/python benchmarks/scheduler_real.py [--trajectories 48] [--kv-gb 0.008]

Both engines run in this process's children with small KV caches, so capacity matters. The workload
is multi-turn: each trajectory generates a turn (lognormal length), "calls a tool" (an asyncio sleep
with lognormal latency, its result appended as tokens), and goes on for 1 + geometric turns. The
same trajectories (same seeds) run under static (whole groups round-robin) and then the dynamic
rules (full L, the paper's free KV // L, reserve=r), prefix caches reset in between. Prints
makespan, engine preemptions and the ratio. The default cache (4096 tokens, K = 2 at L = 1536) is
far smaller than L relative to the mean trajectory (~450 tokens), so the reservation rules starve
the engines here; wall times are noisy on a shared CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tirl.engines.base import SamplingParams
from tirl.engines.config import EngineConfig
from tirl.engines.scheduler import RolloutScheduler


@dataclass
class Plan:
    group: str
    prompt: list[int]
    turns: list[int]  # tokens to generate per turn
    tools: list[tuple[float, list[int]]]  # (latency s, response tokens) after each turn but the last


def make_plans(n: int, group_size: int, max_len: int, vocab: int, seed: int) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        g = i // group_size
        prompt = random.Random(g).choices(range(10, vocab), k=64)  # shared by the group
        turns, tools, used = [], [], len(prompt)
        while True:
            tokens = min(int(rng.lognormvariate(math.log(120), 1.0)) + 8, max_len - used - 40)
            if tokens <= 0:
                break
            turns.append(tokens)
            used += tokens
            if len(turns) >= 6 or rng.random() < 1 / 3:
                break
            response = rng.choices(range(10, vocab), k=int(rng.lognormvariate(math.log(20), 0.5)) + 1)
            tools.append((rng.lognormvariate(math.log(0.3), 1.0), response))
            used += len(response)
        plans.append(Plan(f"p{g}", prompt, turns, tools[: len(turns) - 1]))
    return plans


async def run_trajectory(pool: RolloutScheduler, plan: Plan, max_len: int, seed: int) -> int:
    async with pool.lease(plan.group, max_len) as engine:
        context = list(plan.prompt)
        for t, tokens in enumerate(plan.turns):
            gen = await engine.generate(context, SamplingParams(max_tokens=tokens, seed=seed * 100 + t))
            context += gen.token_ids
            if t < len(plan.tools):
                latency, response = plan.tools[t]
                await asyncio.sleep(latency)  # the tool call; the trajectory keeps its lease meanwhile
                context += response
        return len(context)


async def measure(engines, mode: str, policy: dict, plans: list[Plan], max_len: int) -> dict:
    for e in engines:
        await e.reset_prefix_cache()
    pool = RolloutScheduler(engines, mode=mode, **policy)
    start = time.perf_counter()
    lengths = await asyncio.gather(*(run_trajectory(pool, p, max_len, i) for i, p in enumerate(plans)))
    wall = time.perf_counter() - start
    m = pool.metrics()
    m["wall_s"] = wall
    m["tokens"] = sum(lengths)
    return m


def main(work: Path) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model dir (default: a fresh tiny model)")
    ap.add_argument("--trajectories", type=int, default=48)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--kv-gb", type=float, default=0.008, help="KV cache per engine (GiB)")
    ap.add_argument("--max-len", type=int, default=1536, help="L: tokens reserved per trajectory")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--reserve", type=float, default=0.7, help="share of L reserved by the growth rule")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from tirl.engines.vllm import VLLMEngine

    model = args.model
    if not model:
        from tirl.tiny_model import create_tiny_model

        model = str(create_tiny_model(work / "tiny", preset="tiny"))
    cfg = EngineConfig(backend="vllm", model=model, kv_cache_gb=args.kv_gb, max_model_len=args.max_len + 64)
    engines = [VLLMEngine(cfg, name=f"vllm{i}") for i in range(2)]
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    plans = make_plans(args.trajectories, args.group, args.max_len, vocab, args.seed)
    kv = engines[0].capacity().total_tokens
    print(
        f"2 vLLM engines x {kv} KV tokens, {len(plans)} trajectories (groups of {args.group}), "
        f"L = {args.max_len}: dynamic holds K = {kv // args.max_len} per engine, static {len(plans) // 2}\n"
    )

    async def compare() -> None:
        variants = [
            ("static", "static", {}),
            ("dynamic full L", "dynamic", {"reserve": 1.0}),
            ("dynamic free KV", "dynamic", {"rule": "free_kv"}),
            (f"dynamic r={args.reserve}", "dynamic", {"reserve": args.reserve}),
        ]
        header = (
            f"{'run':>3} {'scheduler':18} {'makespan s':>10} {'vs static':>9} {'tokens':>7} "
            f"{'preemptions':>11} {'peak in flight':>15}"
        )
        print(header)
        print("-" * len(header))
        for r in range(args.repeats):
            baseline = None
            for label, mode, policy in variants:
                m = await measure(engines, mode, policy, plans, args.max_len)
                baseline = baseline or m["wall_s"]
                peaks = "/".join(str(e["peak_in_flight"]) for e in m["engines"])
                print(
                    f"{r:>3} {label:18} {m['wall_s']:10.2f} {baseline / m['wall_s']:8.2f}x {m['tokens']:7d} "
                    f"{m['preemptions']:11d} {peaks:>15}",
                    flush=True,
                )
        print("\n(vs static = static makespan / this makespan; > 1 is faster than static)")
        for e in engines:
            await e.close()

    asyncio.run(compare())


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # its engines, sandboxes and workers die with it, even on kill -9
    with tempfile.TemporaryDirectory(prefix="tirl-scheduler-real-") as tmp:  # the tiny model, unless --model
        main(Path(tmp))
