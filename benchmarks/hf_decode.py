"""The HF engine's decode loop, this tree's vs an earlier commit's, side by side on a rollout's churn.

N agent-like requests through one HFEngine on the demo's model (`tirl.tiny_model` preset "demo",
untrained, sampled with fixed seeds, so both sides generate the same tokens): each request runs
`--turns` turns, and every turn after the first joins the running batch again with its whole context
(prompt, the tokens so far and a 20-token "tool output"), as the agent loop does after a tool call.
Lengths are staggered, so requests leave the batch one by one. The baseline is `tirl/engines/hf.py`
as it was at `--baseline` (default 77de694: transformers' DynamicCache, which copies its whole cache at
every step, and a copy per join and eviction); rounds alternate between the two so that a noisy,
shared machine slows both alike. Prints tokens/s per round and the median ratio new / baseline.

    .venv/bin/python benchmarks/hf_decode.py [--requests 48] [--tokens 96] [--turns 3] [--rounds 3]
        [--threads 1] [--baseline REV]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

import tirl.engines.hf as hf
from tirl.engines import EngineConfig, SamplingParams
from tirl.tiny_model import create_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def _module_at(rev: str, work: Path) -> ModuleType:
    """tirl/engines/hf.py as it was at `rev`, written into `work` and imported under another name."""
    source = subprocess.run(
        ["git", "show", f"{rev}:src/tirl/engines/hf.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    path = work / "hf_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("hf_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_baseline"] = module
    spec.loader.exec_module(module)
    return module


async def _agent(engine, prompt: list[int], i: int, tokens: int, turns: int) -> list[int]:
    context, out = list(prompt), []
    for turn in range(turns):
        params = SamplingParams(
            temperature=1.0, max_tokens=tokens // 2 + (i * 7) % tokens, seed=1000 * turn + i
        )
        gen = await engine.generate(context, params)
        out += gen.token_ids
        context += gen.token_ids + [5 + (i + k) % 900 for k in range(20)]  # the tool's reply
    return out


async def _round(engine, prompts: list[list[int]], tokens: int, turns: int) -> tuple[float, list]:
    start = time.perf_counter()
    outs = await asyncio.gather(*(_agent(engine, p, i, tokens, turns) for i, p in enumerate(prompts)))
    return sum(map(len, outs)) / (time.perf_counter() - start), outs


async def main(work: Path) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--baseline", default="77de694")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = create_tiny_model(work / "model", preset="demo")
    cfg = EngineConfig(model=str(model_dir), device="cpu", max_model_len=1024, max_batch_size=args.requests)
    engines = {"baseline": _module_at(args.baseline, work).HFEngine(cfg), "new": hf.HFEngine(cfg)}
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 1000, (60 + 5 * (i % 8),), generator=gen).tolist() for i in range(args.requests)
    ]
    rates: dict[str, list[float]] = {side: [] for side in engines}
    outs: dict[str, list] = {}
    try:
        for r in range(args.rounds):
            for side, engine in engines.items():
                rate, outs[side] = await _round(engine, prompts, args.tokens, args.turns)
                rates[side].append(rate)
                print(f"round {r}: {side:>8} {rate:8.0f} tokens/s", flush=True)
    finally:
        for engine in engines.values():
            await engine.close()
    ratio = statistics.median(n / b for n, b in zip(rates["new"], rates["baseline"], strict=True))
    print(
        f"{args.requests} requests x {args.turns} turns, {args.threads} thread(s): new / {args.baseline} = "
        f"{ratio:.2f}x tokens/s (median of {args.rounds} paired rounds); same tokens: {outs['new'] == outs['baseline']}"
    )


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # its engines, sandboxes and workers die with it, even on kill -9
    with tempfile.TemporaryDirectory(prefix="tirl-hf-decode-") as tmp:  # the model and the baseline
        asyncio.run(main(Path(tmp)))
