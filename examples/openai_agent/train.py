"""GRPO-RoC on tirl's demo task, the rollouts played by a plain OpenAI-client agent (agent.py).

    .venv/bin/python examples/openai_agent/train.py --model runs/demo/sft --problems runs/demo/data/rl_train.jsonl \
        --steps 20 --out runs/openai_agent

The agent talks to tirl's OpenAI-compatible endpoint, which records each episode's exact tokens, loss
mask and log-probs; the episodes are then scored, down-sampled by RoC and trained on exactly as
`tirl train` does (tirl.rl.trainer's roc_select and build_samples, the same learner), and the new
weights go into the engine before the next step. Start from a model that knows the tool protocol
(the SFT model of `tirl demo`: runs/demo/sft); a random model never earns a reward. The endpoint takes
a bearer token made for this run (kept in memory, handed to the agent's client as its api_key), so no
other program or web page on the machine can read or end the episodes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import shutil
import time
import traceback
from pathlib import Path

from openai import AsyncOpenAI

from agent import solve  # this directory is on sys.path when the script runs
from tirl.agent.openai_server import ChatRecorder, OpenAIEndpoint
from tirl.data.loaders import load_problems
from tirl.demo.pipeline import load_settings
from tirl.demo.synthetic import generate
from tirl.distributed.groups import init_distributed
from tirl.engines import EngineConfig, SingleEnginePool, load_tokenizer
from tirl.engines.hf import HFEngine
from tirl.reward import RewardConfig, RewardPool
from tirl.rl.checkpoint import AGENT_FILE, resolve_model_path
from tirl.rl.config import AlgorithmConfig, OptimConfig
from tirl.rl.local_learner import LocalLearner
from tirl.rl.policy import Policy
from tirl.rl.trainer import build_samples, roc_select
from tirl.runtime.base import load_sources


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", required=True, help="model directory or tirl run directory (e.g. runs/demo/sft)"
    )
    p.add_argument(
        "--problems",
        default="",
        help="training problems: a JSONL file (or any file tirl.data.loaders.load_problems reads), e.g. "
        "runs/demo/data/rl_train.jsonl; default: the demo's RL split regenerated (the same 2000 problems "
        "`tirl demo` writes there with its default settings)",
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8, help="problems per step")
    p.add_argument("--group", type=int, default=8, help="G: rollouts trained on per problem (2G are played)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=192, help="per turn")
    p.add_argument("--seed", type=int, default=0, help="order of the problems, sampling, RoC")
    p.add_argument("--metrics", default="", help="JSONL file for one line of metrics per step")
    p.add_argument(
        "--out",
        default="",
        help="save the trained model here as a tirl run (OUT/checkpoints/step_N): `tirl eval --model OUT`",
    )
    return p.parse_args(argv)


async def play_group(endpoint: OpenAIEndpoint, token: str, problem, step: int, n: int, args) -> list:
    """n episodes of one problem by the agent, each recorded as a tirl Trajectory."""

    async def one(j: int):
        tid = endpoint.trajectory_id()  # unguessable, issued by the endpoint
        async with AsyncOpenAI(base_url=endpoint.base_url(tid), api_key=token, max_retries=0) as client:
            await solve(
                client,
                problem.problem,
                seed=step * 1000 + j,
                max_turns=args.max_turns,
                max_tokens=args.max_tokens,
            )
        return await asyncio.to_thread(endpoint.finish, tid, problem.id, j)

    # An episode that fails (the agent or the endpoint raised) is reported and left out; the others
    # still train. Raising instead would close the endpoint under episodes still being finished.
    done = await asyncio.gather(*(one(j) for j in range(n)), return_exceptions=True)
    for result in done:
        if isinstance(result, Exception):
            traceback.print_exception(result)
        elif isinstance(result, BaseException):
            raise result
    return [t for t in done if not isinstance(t, BaseException)]


async def train(args: argparse.Namespace) -> list[dict]:
    model_path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(model_path)
    alg = AlgorithmConfig(prompts_per_step=args.prompts, group_size=args.group, oversample=2, roc="sample")
    policy = Policy(
        model_path,
        OptimConfig(lr=args.lr, warmup_steps=3, weight_decay=0.0, device="cpu"),
        init_distributed("cpu"),
        args.steps,
    )
    learner = LocalLearner(policy)
    engine = HFEngine(EngineConfig(model=model_path, device="cpu", max_model_len=1024, max_batch_size=128))
    budget = args.max_turns * (args.max_tokens + 128)
    recorder = ChatRecorder(
        SingleEnginePool(engine), tokenizer, max_response_tokens=budget, prefill="<reason>"
    )
    token = secrets.token_urlsafe(24)  # this run's only: in memory, never written down
    endpoint = OpenAIEndpoint(recorder, token=token)
    problems = training_problems(args.problems)
    random.Random(args.seed).shuffle(problems)  # a seeded order (cycled when steps x prompts is more)
    rng = random.Random(args.seed)
    history = []
    try:
        async with RewardPool(RewardConfig(workers=1)) as scorer:
            for step in range(args.steps):
                history.append(
                    await one_step(step, problems, rng, (endpoint, token), scorer, learner, engine, alg, args)
                )
                print(json.dumps(history[-1]), flush=True)
                if args.metrics:
                    with open(args.metrics, "a") as f:
                        f.write(json.dumps(history[-1]) + "\n")
        if args.out:
            save(learner, tokenizer, model_path, args)
    finally:
        endpoint.close()
        await engine.close()
    return history


def training_problems(path: str) -> list:
    """The problems of `path`, or the demo's RL split: the draw after its SFT problems (generate is
    prefix-stable, so this is runs/demo/data/rl_train.jsonl of a default `tirl demo`)."""
    if path:
        return load_problems(path)
    demo = load_settings().demo
    return generate(demo.sft_problems + demo.rl_problems, "train", seed=demo.seed)[demo.sft_problems :]


async def one_step(step, problems, rng, served, scorer, learner, engine, alg, args) -> dict:
    """One GRPO-RoC step; `served`: the endpoint and its token."""
    start = time.perf_counter()
    batch = [problems[(step * args.prompts + i) % len(problems)] for i in range(args.prompts)]
    groups = await asyncio.gather(
        *(play_group(*served, p, step, alg.oversample * alg.group_size, args) for p in batch)
    )
    for problem, group in zip(batch, groups, strict=True):
        rewards = await scorer.score_many([(t.model_turns, problem.answer) for t in group])
        for t, r in zip(group, rewards, strict=True):
            t.reward = float(r) if t.scored else 0.0
    kept = [roc_select(g, alg, rng.randrange(2**31)) for g in groups]
    samples = build_samples(groups, kept, alg.advantage)
    update = learner.update(samples, alg) if samples else {}
    # the in-process engine generates the next step with the new weights (tirl.runtime.handoff.InProcess)
    load_sources([engine], learner.sync_tensors(), learner.device)
    everyone = [t for g in groups for t in g]
    return {
        "step": step,
        "reward": sum(t.reward for t in everyone) / len(everyone),
        "tool_calls": sum(t.num_tool_calls for t in everyone) / len(everyone),
        "response_tokens": sum(t.response_length for t in everyone) / len(everyone),
        "samples": len(samples),
        "failed_episodes": len(batch) * alg.oversample * alg.group_size - len(everyone),
        "loss": update.get("train/loss"),
        "seconds": round(time.perf_counter() - start, 1),
    }


def save(learner, tokenizer, model_path: str, args: argparse.Namespace) -> None:
    """The trained model as a tirl checkpoint, with the agent settings the model it started from was
    trained with (tirl eval and chat use them by default)."""
    learner.stage_checkpoint(Path(args.out), args.steps)  # the state as it is, then moved into place
    learner.publish_checkpoint(Path(args.out), args.steps, tokenizer, {"step": args.steps}, keep_last=1)
    saved = Path(args.out) / "checkpoints" / f"step_{args.steps:06d}" / "model"
    if (Path(model_path) / AGENT_FILE).is_file():
        shutil.copy(Path(model_path) / AGENT_FILE, saved / AGENT_FILE)
    print(f"saved: {saved}", flush=True)


if __name__ == "__main__":
    asyncio.run(train(parse_args()))
