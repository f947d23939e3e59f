"""What resume depends on, checked in seconds (the SIGKILL resume tests take minutes): every RNG is
restored exactly, checkpoints are ordered by step (not by name), half-written ones are ignored, and the
latest is the highest step."""

from __future__ import annotations

import random

import numpy as np
import torch

from tirl.rl.checkpoint import latest_checkpoint, list_checkpoints, rng_states, set_rng_states


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_every_rng_continues_exactly_after_a_restore():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    _draws()
    saved = rng_states()
    expected = [_draws() for _ in range(3)]
    random.seed(9), np.random.seed(9), torch.manual_seed(9)  # a resumed process starts elsewhere
    set_rng_states(saved)
    assert [_draws() for _ in range(3)] == expected


def test_each_rng_is_restored_on_its_own():
    """A restore that skipped one generator (or restored one from another's state) fails here."""
    saved = rng_states()
    want = _draws()
    for i, reseed in enumerate(
        (lambda: random.seed(5), lambda: np.random.seed(5), lambda: torch.manual_seed(5))
    ):
        set_rng_states(saved)
        reseed()
        got = _draws()
        assert [g == w for g, w in zip(got, want, strict=True)] == [j != i for j in range(3)]


def test_checkpoints_are_ordered_by_step_and_half_written_ones_ignored(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step_000010", "step_000009", "step_1000000", "step_000100"):
        (root / name).mkdir(parents=True)
    (root / ".tmp_step_000200_123").mkdir()  # a save killed midway
    (root / "step_000300").write_text("not a directory")
    (root / "step_x").mkdir()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [9, 10, 100, 1000000]
    assert latest_checkpoint(tmp_path) == root / "step_1000000"


def test_a_run_without_checkpoints_has_no_latest(tmp_path):
    assert list_checkpoints(tmp_path) == [] and latest_checkpoint(tmp_path) is None
