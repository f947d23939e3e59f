"""The engine/trainer log-prob gap on a real model, per engine and dtype (docs/real-model.md).

Each engine (hf, vllm) in each dtype samples the same prompts; the trainer's forward pass (fp32, and
bf16 autocast as `optim.dtype=bfloat16` runs it) scores the sampled tokens; the table is the mean and
max |engine - trainer| log-prob per token. GRPO's ratio pi/pi_old and the `train/engine_logprob_gap`
alert read exactly this quantity.

    .venv/bin/python benchmarks/logprob_gap.py --model models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import itertools

import torch

PROBLEMS = [
    "Find the remainder when 87 to the power 384 is divided by 322.",
    "Count the integers between 1 and 587 inclusive that are multiples of 13 or 44.",
    "What is the sum of k^3 for k from 1 to 372, modulo 301?",
    "Find the digit sum of 42 to the power 41.",
]


async def sample(backend: str, dtype: str, model: str, prompts: list[list[int]], tokens: int) -> list[tuple]:
    from tirl.engines import EngineConfig, SamplingParams, build_engines

    cfg = EngineConfig(
        backend=backend, model=model, device="cpu", dtype=dtype, max_model_len=1024, kv_cache_gb=0.3
    )
    [engine] = build_engines(cfg)
    try:
        params = [SamplingParams(temperature=1.0, max_tokens=tokens, seed=i) for i in range(len(prompts))]
        outs = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params, strict=True)))
    finally:
        await engine.close()
    return [(p, o.token_ids, o.logprobs) for p, o in zip(prompts, outs, strict=True)]


def trainer_logprobs(model, prompt: list[int], generated: list[int], bf16: bool) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(generated) - 1)
    return logp[positions, torch.tensor(generated)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--backends", default="hf,vllm")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from tirl.agent.config import AgentConfig
    from tirl.agent.protocol import build_prompt_ids
    from tirl.engines import load_tokenizer

    tok = load_tokenizer(args.model)
    agent = AgentConfig(use_chat_template=False, system_prompt="Use the python tool.")
    prompts = [build_prompt_ids(tok, p, agent) for p in PROBLEMS]
    trainer = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    print(
        "| engine | engine dtype | trainer | tokens | mean gap | max gap |\n| --- | --- | --- | --- | --- | --- |"
    )
    for backend, dtype in itertools.product(args.backends.split(","), args.dtypes.split(",")):
        samples = asyncio.run(sample(backend, dtype, args.model, prompts, args.tokens))
        for bf16 in (False, True):
            gaps = torch.cat(
                [(torch.tensor(lp) - trainer_logprobs(trainer, p, g, bf16)).abs() for p, g, lp in samples]
            )
            trained = "bf16 autocast" if bf16 else "fp32"
            print(f"| {backend} | {dtype} | {trained} | {len(gaps)} | {gaps.mean():.2e} | {gaps.max():.2e} |")


if __name__ == "__main__":
    from tirl.lifetime import children_die_with_me

    children_die_with_me()  # its engines and evaluations die with it, even on kill -9
    main()
