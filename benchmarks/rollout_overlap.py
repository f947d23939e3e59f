"""How well the agent loop hides tool latency behind generation.

Many trajectories run concurrently on one HF engine; each makes several tool calls that sleep for
real in the sandbox. The same turns are then replayed with no tools at all (same contexts, same
number of tokens per turn, greedy, so the same tokens): the pure generation time of that work.
Ideal ratio rollout / replay = 1.0x (tool time fully hidden).

The tiny model is first taught (a few seconds of fine-tuning) to follow one scripted tool-use
conversation, so it really emits the calls through the real engine and the real sandbox.

    python benchmarks/rollout_overlap.py --trajectories 64 --calls 3 --tool-ms 200
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.agent.scripted: the teaching helper

from tests.agent.scripted import Script, call, record, teach

from tirl.agent import AgentConfig, rollout
from tirl.agent.trajectory import Trajectory
from tirl.data.problem import Problem
from tirl.engines import EngineConfig, SamplingParams, SingleEnginePool, load_tokenizer
from tirl.engines.hf import HFEngine
from tirl.sandbox import Sandbox


def script(calls: int, tool_ms: int, filler: int) -> Script:
    think = " hmm" * filler
    code = "import time\ntime.sleep({s})\nprint({k})"
    turns = [f"{think} {call(code.format(s=tool_ms / 1000, k=k))}" for k in range(calls)]
    turns.append(f"{think}</reason><answer>\\boxed{{{calls}}}</answer><|im_end|>")
    return Script(Problem("bench", "Count the calls.", str(calls)), turns)


def turn_spans(traj: Trajectory) -> list[tuple[int, int]]:
    """(start, length) of each generated turn inside response_ids."""
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(traj.loss_mask):
        if m and (i == 0 or not traj.loss_mask[i - 1]):
            spans.append((i, 0))
        if m:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1)
    return spans


async def replay(engine: HFEngine, traj: Trajectory) -> None:
    """The same turns with no tool wait: same contexts, same token counts."""
    for start, n in turn_spans(traj):
        ctx = traj.prompt_ids + traj.response_ids[:start]
        await engine.generate(ctx, SamplingParams(temperature=0.0, max_tokens=n))


async def main(args: argparse.Namespace, work: Path) -> None:
    import torch

    from tirl.tiny_model import create_tiny_model

    # A tiny model gains nothing from intra-op threads, and on a busy 2-core machine they spin against
    # each other (measured: 10-20x slower elementwise ops at 2 threads than at 1).
    torch.set_num_threads(args.threads)

    model_dir = create_tiny_model(work / "tiny", preset=args.preset)
    tok = load_tokenizer(model_dir)
    cfg = AgentConfig(
        system_prompt="Use the tool.",
        user_prompt="{problem}",
        use_chat_template=False,
        temperature=0.0,
        max_turns=args.calls + 2,
        max_response_tokens=args.budget,
        show_exec_time=False,  # the taught model replays its script only on identical tool text
    )
    async with Sandbox(slots=args.slots or args.trajectories, preload=[]) as sandbox:
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        rec = await record(tok, sandbox, script(args.calls, args.tool_ms, args.filler), cfg)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        loss = teach(model, [rec], steps=300)
        print(f"taught the scripted conversation in {time.perf_counter() - t0:.1f} s (loss {loss:.4f})")
        cfg_engine = EngineConfig(model=str(model_dir), device=args.device, max_batch_size=args.trajectories)
        engine = HFEngine(
            cfg_engine, model=model.to(args.device if args.device != "auto" else "cpu"), tokenizer=tok
        )
        pool = SingleEnginePool(engine)
        problem = script(args.calls, args.tool_ms, args.filler).problem
        for rnd in range(args.rounds):
            t = time.perf_counter()
            [trajs] = await rollout(pool, tok, sandbox, [problem], args.trajectories, cfg)
            rollout_s = time.perf_counter() - t
            t = time.perf_counter()
            await asyncio.gather(*(replay(engine, tr) for tr in trajs))
            replay_s = time.perf_counter() - t
            calls = [c for tr in trajs for c in tr.tool_calls]
            ok = sum(c.status == "ok" for c in calls)
            gen_tokens = sum(sum(tr.loss_mask) for tr in trajs)
            finish = {
                r: sum(tr.finish_reason == r for tr in trajs) for r in {tr.finish_reason for tr in trajs}
            }
            print(
                f"round {rnd}: {len(trajs)} trajectories, {len(calls)} tool calls ({ok} ok, "
                f"{sum(tr.tool_wait_seconds for tr in trajs):.1f} s of tool wait), {gen_tokens} generated tokens, "
                f"finish {finish}"
            )
            print(
                f"  rollout {rollout_s:.2f} s  vs  pure generation of the same tokens {replay_s:.2f} s  "
                f"->  ratio {rollout_s / replay_s:.2f}x  (ideal 1.0x)"
            )
        await engine.close()


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # its engines, sandboxes and workers die with it, even on kill -9
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trajectories", type=int, default=64)
    p.add_argument("--calls", type=int, default=3, help="tool calls per trajectory")
    p.add_argument("--tool-ms", type=int, default=200, help="how long each tool call sleeps")
    p.add_argument("--filler", type=int, default=30, help="reasoning words per turn")
    p.add_argument("--slots", type=int, default=0, help="sandbox slots (default: one per trajectory)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--budget", type=int, default=1024, help="response tokens per trajectory")
    with tempfile.TemporaryDirectory(prefix="tirl-rollout-overlap-") as tmp:  # the taught tiny model
        asyncio.run(main(p.parse_args(), Path(tmp)))
