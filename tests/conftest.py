"""Shared fixtures: tiny real components (a tiny Qwen3 model), never mocks of them."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialized tiny Qwen3 model + locally trained tokenizer, created once per session."""
    from tirl.tiny_model import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("tiny_model"), preset="tiny", seed=0)
