"""Both engines on the real model (30 layers, a real BPE tokenizer): seeded sampling, log-probs equal to
the trainer's forward pass within 1e-3 nats per token in fp32, and a turn that ends at <|im_end|>."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from tests.logprobs import check_seeded_with_reference_logprobs

from tirl.agent.config import AgentConfig
from tirl.agent.protocol import build_prompt_ids
from tirl.engines import EngineConfig, SamplingParams, build_engines

pytestmark = pytest.mark.timeout(900)  # two engine starts of a 135M model on a loaded 2-core machine


def _prompt(tokenizer) -> list[int]:
    cfg = AgentConfig(use_chat_template=False, system_prompt="Use the python tool.")
    return build_prompt_ids(tokenizer, "What is 17 times 23?", cfg)


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_engine_logprobs_are_the_trainers_and_turns_end_at_im_end(
    backend, smollm2_dir: Path, smollm2_tokenizer
):
    cfg = EngineConfig(
        backend=backend, model=str(smollm2_dir), device="cpu", max_model_len=1024, kv_cache_gb=0.3
    )
    threads = torch.get_num_threads()
    if backend == "hf":  # seeded sampling is batch-invariant with one intra-op thread (tirl.engines.hf)
        torch.set_num_threads(1)
    [engine] = build_engines(cfg)

    async def check() -> None:
        prompt = _prompt(smollm2_tokenizer)
        await check_seeded_with_reference_logprobs(engine, prompt, smollm2_dir)
        done = await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=200, seed=1))
        assert done.finish_reason == "stop"  # the instruct model ends its turn itself
        assert smollm2_tokenizer.decode(done.token_ids[-1:]) == "<|im_end|>"

    try:
        asyncio.run(check())
    finally:
        asyncio.run(engine.close())
        torch.set_num_threads(threads)
