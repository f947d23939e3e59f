"""benchmarks/lora_demo.py: what differs between its two sides, the trainer state it counts, its table."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_demo import BYTES_PER_TRAINABLE, main, side_overrides, table, trainer_state
from tirl.demo.pipeline import load_settings, train_config


def _cfg(model: Path, side: str):
    settings = load_settings(overrides=side_overrides(side, rank=4, lr=3e-3))
    return train_config(settings, model, "data.jsonl", Path("out"), side)


def test_only_the_lora_side_changes_the_optimizer():
    assert side_overrides("full", 16, 3e-3) == []
    lora = load_settings(overrides=side_overrides("lora", 16, 3e-3)).train["optim"]
    assert lora["lr"] == 3e-3 and lora["lora"] == {"enabled": True, "rank": 16, "alpha": 32}


def test_trainer_state_counts_the_adapters_only_under_lora(tiny_model_dir):
    full, lora = trainer_state(_cfg(tiny_model_dir, "full")), trainer_state(_cfg(tiny_model_dir, "lora"))
    assert full["trainable"] == full["parameters"]
    assert 0 < lora["trainable"] < full["trainable"] / 5
    # the adapters come on top of the frozen base
    assert lora["parameters"] == full["parameters"] + lora["trainable"]
    assert lora["grad_adamw_bytes"] == lora["trainable"] * BYTES_PER_TRAINABLE


def test_table_has_a_row_per_side():
    row = {
        "lr": 3e-4,
        "trainable": 1000,
        "grad_adamw_bytes": 12000,
        "peak_rss_mb": 900.0,
        "rl_wall_s": 400.0,
        "step_s": 13.3,
        "reward_last5": 0.5,
        "engine_gap_max": 2e-7,
        "heldout_accuracy": 70.0,
    }
    text = table([row | {"run": "full"}, row | {"run": "lora", "engine_gap_max": None}])
    assert [line.split()[0] for line in text.splitlines()[1:]] == ["full", "lora"]
    assert "70.0%" in text and "n/a" in text


def test_a_directory_that_is_not_a_finished_demo_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="not a finished `tirl demo` directory"):
        main(["--demo", str(tmp_path), "--out", str(tmp_path / "out")])
