"""High-entropy tokens and their two kinds (the paper's Section 7).

The paper takes the top 20% of tokens by the policy's entropy and finds two kinds among them:
  - forking tokens: inside the model's own reasoning, where it decides how to go on ("wait",
    "but", "alternatively"; in the tiny demo: which code to write, whether to call the tool);
  - reflection tokens: right after a tool response, where the model reacts to execution feedback
    (an error, an unexpected value).
Here a generated token is a reflection token when it is among the first `window` generated tokens
after a tool-response segment (loss mask 0 -> 1), and a forking token otherwise. The window is our
operationalization: the paper names the tokens by inspection and gives no cut-off. Only the model's
own tokens (loss mask 1) are ranked; tool responses are not its choices.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Kind = Literal["forking", "reflection"]
KINDS: tuple[Kind, ...] = ("forking", "reflection")


def classify_positions(loss_mask: list[int], window: int) -> list[Kind | None]:
    """Per response token: None for tool-response tokens, "reflection" for the first `window`
    generated tokens after a tool response, "forking" for every other generated token."""
    out: list[Kind | None] = []
    since_tool: int | None = None  # generated tokens since the last tool response; None before any
    for m in loss_mask:
        if not m:
            out.append(None)
            since_tool = 0
            continue
        if since_tool is not None:
            since_tool += 1
        out.append("reflection" if since_tool is not None and since_tool <= window else "forking")
    return out


def entropy_threshold(entropies: list[list[float]], masks: list[list[int]], top: float) -> float:
    """The entropy above which a generated token is in the top `top` share of all generated tokens."""
    values = [
        e for ents, mask in zip(entropies, masks, strict=True) for e, m in zip(ents, mask, strict=True) if m
    ]
    if not values:
        raise ValueError("the trajectories have no generated token to rank")
    return float(np.quantile(values, 1.0 - top))


@dataclass
class HighEntropyTokens:
    """Counts over a set of trajectories under one model."""

    threshold: float
    top: float
    window: int
    generated: Counter = field(default_factory=Counter)  # kind -> generated tokens of that kind
    high: Counter = field(default_factory=Counter)  # kind -> high-entropy tokens of that kind
    tokens: dict[str, Counter] = field(default_factory=lambda: {k: Counter() for k in KINDS})

    def share(self, kind: Kind) -> float:
        """Share of the high-entropy tokens that are of `kind`."""
        total = sum(self.high.values())
        return self.high[kind] / total if total else 0.0

    def rate(self, kind: Kind) -> float:
        """Share of the generated tokens of `kind` that are high-entropy (1/5 everywhere = no pattern)."""
        return self.high[kind] / self.generated[kind] if self.generated[kind] else 0.0

    def to_dict(self, most_common: int = 20) -> dict:
        return {
            "threshold": round(self.threshold, 4),
            "top": self.top,
            "window": self.window,
            "generated": dict(self.generated),
            "high_entropy": dict(self.high),
            "share": {k: round(self.share(k), 4) for k in KINDS},
            "rate": {k: round(self.rate(k), 4) for k in KINDS},
            "most_common": {k: self.tokens[k].most_common(most_common) for k in KINDS},
        }


def high_entropy_tokens(
    entropies: list[list[float]],
    masks: list[list[int]],
    response_ids: list[list[int]],
    token_text,
    top: float = 0.2,
    window: int = 16,
) -> HighEntropyTokens:
    """Rank generated tokens by entropy, keep the top share, and count them by kind and by text.

    `token_text(id) -> str` names a token for the frequency tables (e.g. a tokenizer's decode)."""
    if not 0 < top <= 1:
        raise ValueError(f"top must be in (0, 1], got {top}")
    result = HighEntropyTokens(entropy_threshold(entropies, masks, top), top, window)
    for ents, mask, ids in zip(entropies, masks, response_ids, strict=True):
        for e, kind, tok in zip(ents, classify_positions(mask, window), ids, strict=True):
            if kind is None:
                continue
            result.generated[kind] += 1
            if e >= result.threshold:
                result.high[kind] += 1
                result.tokens[kind][token_text(tok)] += 1
    return result
