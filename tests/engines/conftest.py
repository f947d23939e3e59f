"""Shared engine fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    """A short ChatML prompt, up to the assistant's `<reason>`, in the tiny model's tokens."""
    return tokenizer("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n<reason>")["input_ids"]
