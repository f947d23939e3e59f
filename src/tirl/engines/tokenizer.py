"""The model's tokenizer, loaded once for every engine backend and for the agent's prompts."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: str | Path):
    """The model's tokenizer (fast, with its chat template)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"cannot load a tokenizer from {str(path)!r}: give a model directory with tokenizer files "
            f"(e.g. one written by `tirl model init --preset tiny --out PATH`). Cause: {exc}"
        ) from exc
