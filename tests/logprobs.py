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
