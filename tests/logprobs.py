"""What a transformers forward pass gives as the log-probs of generated tokens: the reference engines
and the agent loop's recorded log-probs are checked against."""

from __future__ import annotations

import torch


def reference_logprobs(
    model: torch.nn.Module, prompt: list[int], generated: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """log p(generated[i] | prompt + generated[:i]) at `temperature`, from one forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(generated) - 1)
    return logp[positions, torch.tensor(generated, dtype=torch.long)]


async def check_seeded_with_reference_logprobs(engine, prompt: list[int], model_dir) -> None:
    """An engine's sampling is seeded (same seed, same tokens, here side by side in one batch; another
    seed, others) and the log-probs it reports are the model's under transformers: the contract every
    backend keeps (the HF engine on CPU with one intra-op thread: tirl.engines.hf)."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from tirl.engines.base import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=24, seed=7)
    first, again, other = await asyncio.gather(
        engine.generate(prompt, params),
        engine.generate(prompt, params),
        engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=24, seed=8)),
    )
    assert first.token_ids == again.token_ids and first.token_ids != other.token_ids
    assert len(first.logprobs) == len(first.token_ids) and first.finish_reason in ("stop", "length")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = reference_logprobs(model, prompt, first.token_ids)
    torch.testing.assert_close(torch.tensor(first.logprobs), ref, atol=1e-3, rtol=0)
