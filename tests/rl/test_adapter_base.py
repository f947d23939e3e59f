"""A LoRA adapter finds its base model after the run moves: where the base lay relative to the adapter
first (runs moved together, e.g. a runs/ directory copied elsewhere), else the absolute path peft's
adapter_config.json names (the run moved alone); a base found at neither is one line saying so."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("peft")


def _adapter(tiny_model_dir: Path, root: Path) -> tuple[Path, Path]:
    """root/base (a copy of the tiny model) and root/runs/r/checkpoints/step_000001/adapter trained on it."""
    from transformers import AutoModelForCausalLM

    from tirl.rl.config import LoraConfig
    from tirl.rl.lora import apply_lora, save_adapter

    base = root / "base"
    shutil.copytree(tiny_model_dir, base)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(base), LoraConfig(enabled=True, rank=4))
    adapter = root / "runs" / "r" / "checkpoints" / "step_000001" / "adapter"
    save_adapter(model, adapter, str(base.resolve()), is_main=True)
    return base, adapter


def test_an_adapter_and_its_base_moved_together_still_merge(tiny_model_dir, tmp_path):
    from tirl.rl.lora import adapter_base, is_model_dir, merge_adapter

    _adapter(tiny_model_dir, tmp_path / "before")
    shutil.move(tmp_path / "before", tmp_path / "after")  # the absolute path in adapter_config.json is gone
    adapter = tmp_path / "after" / "runs" / "r" / "checkpoints" / "step_000001" / "adapter"
    assert adapter_base(adapter) == str((tmp_path / "after" / "base").resolve())
    merged = merge_adapter(adapter, tmp_path / "merged")
    assert is_model_dir(merged) and not any(p.name.startswith("adapter_") for p in merged.iterdir())


def test_a_run_moved_without_its_base_finds_the_base_where_it_was(tiny_model_dir, tmp_path):
    from tirl.rl.lora import adapter_base

    base, _ = _adapter(tiny_model_dir, tmp_path / "a")
    shutil.move(tmp_path / "a" / "runs", tmp_path / "elsewhere")
    adapter = tmp_path / "elsewhere" / "r" / "checkpoints" / "step_000001" / "adapter"
    assert adapter_base(adapter) == str(base.resolve())


def test_a_base_that_moved_away_is_one_line_naming_both_places_and_the_fix(tiny_model_dir, tmp_path):
    from tirl.rl.checkpoint import resolve_model_path

    base, adapter = _adapter(tiny_model_dir, tmp_path)
    shutil.move(base, tmp_path / "base-moved")
    with pytest.raises(FileNotFoundError) as raised:
        resolve_model_path(str(adapter.parent))
    message = str(raised.value)
    assert "\n" not in message and f"{adapter}: its base model moved: it is neither at {base} " in message
    assert f"nor at {base.resolve()}; " in message and "base_model_name_or_path in " in message
