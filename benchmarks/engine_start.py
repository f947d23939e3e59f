"""A vLLM CPU engine with its worker in a process of its own (vLLM's CPU default) vs inside the engine
core (what tirl picks on <= 2 cores: tirl.engines.vllm.engine_env), side by side, alternating.

    .venv/bin/python benchmarks/engine_start.py [--requests 128] [--tokens 128] [--rounds 2]

Each variant runs in a fresh subprocess on the demo's tiny model (randomly initialized: most requests
run to --tokens) and times what every demo phase and RL step pays: the engine's start, a batch of
seeded requests at once (an RL step's rollouts), and its close. Prints seconds per variant, the ratio
separate / in-core, and whether both sampled the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = """
import asyncio, hashlib, json, sys, time
from pathlib import Path
import tirl.engines.vllm as V
from tirl.engines.base import SamplingParams
from tirl.engines.config import EngineConfig
from tirl.tiny_model import create_tiny_model

def main():
    out, separate, requests, tokens = Path(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
    if separate:
        V.IN_CORE_WORKER_MAX_CPUS = 0  # vLLM's own choice: the multiprocessing executor
    model = create_tiny_model(out / "model", preset="demo", seed=0)
    cfg = EngineConfig(backend="vllm", model=str(model), max_model_len=1024, kv_cache_gb=0.5, seed=0)
    t = time.perf_counter()
    engine = V.VLLMEngine(cfg)
    start = time.perf_counter() - t
    backend = engine._llm.vllm_config.parallel_config.distributed_executor_backend

    async def rollouts():
        params = [SamplingParams(max_tokens=tokens, seed=i) for i in range(requests)]
        prompts = [[5 + (i * 7 + j) % 1000 for j in range(48)] for i in range(requests)]
        t = time.perf_counter()
        gens = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params)))
        seconds = time.perf_counter() - t
        t = time.perf_counter()
        await engine.close()
        return gens, seconds, time.perf_counter() - t

    gens, generate, close = asyncio.run(rollouts())
    digest = hashlib.sha256(json.dumps([g.token_ids for g in gens]).encode()).hexdigest()[:12]
    n = sum(len(g.token_ids) for g in gens)
    print("RESULT " + json.dumps(dict(start=start, generate=generate, close=close, tokens=n, digest=digest,
                                      backend=backend)))

if __name__ == "__main__":
    main()
"""


def run(separate: bool, requests: int, tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "child.py")  # a file: vLLM's spawned engine core re-imports __main__
        with open(script, "w") as f:
            f.write(CHILD)
        out = subprocess.run(
            [sys.executable, script, tmp, str(int(separate)), str(requests), str(tokens)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT"))[len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    cpus = len(os.sched_getaffinity(0))
    print(f"loadavg {os.getloadavg()[0]:.1f}, {cpus} cpus; {args.requests} requests x {args.tokens} tokens")
    print("round | phase | separate worker s | in-core worker s | separate / in-core")
    for r in range(1, args.rounds + 1):
        sep, core = run(True, args.requests, args.tokens), run(False, args.requests, args.tokens)
        for phase in ("start", "generate", "close"):
            print(f"{r} | {phase} | {sep[phase]:.2f} | {core[phase]:.2f} | {sep[phase] / core[phase]:.2f}x")
        same = "yes" if sep["digest"] == core["digest"] else "NO"
        print(f"{r} | executors {sep['backend']} / {core['backend']}; same tokens: {same} ({core['tokens']})")


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # its engines die with it, even on kill -9
    main()
