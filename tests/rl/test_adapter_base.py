"""A LoRA adapter finds its base model after the run moves: where the base lay relative to the adapter
first (runs moved together, e.g. a runs/ directory copied elsewhere), else the absolute path peft's
adapter_config.json names (the run moved alone); a base found at neither is one line saying so."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

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


def test_a_peft_adapter_on_a_bf16_base_merges_into_fp32_safetensors_again_only_when_newer(
    tiny_model_dir, tmp_path
):
    """An adapter as peft alone saves one (no tirl base file: its config names the base) on a base
    stored in bf16: the merge, into a directory whose parents do not exist yet, loads the base in fp32
    and writes fp32 safetensors. `<adapter>-merged` is merged again only when the adapter's weights are
    newer than it, not when they are as old."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from tirl.rl.lora import BASE_RELATIVE, adapter_base, merge_adapter, merged_adapter_dir

    base, adapter = _adapter(tiny_model_dir, tmp_path)
    AutoModelForCausalLM.from_pretrained(base).to(torch.bfloat16).save_pretrained(base)
    (adapter / BASE_RELATIVE).unlink()
    assert adapter_base(adapter) == str(base.resolve())
    merged = merge_adapter(adapter, tmp_path / "new" / "nested" / "merged")
    assert (merged / "model.safetensors").is_file() and not (merged / "pytorch_model.bin").exists()
    with safe_open(merged / "model.safetensors", "pt") as f:
        assert {f.get_tensor(name).dtype for name in f.keys()} == {torch.float32}  # noqa: SIM118 (not a dict)

    config = merged_adapter_dir(adapter) / "config.json"
    made = config.stat().st_mtime_ns
    os.utime(adapter / "adapter_model.safetensors", ns=(made, made))  # as old as the merge: kept
    assert merged_adapter_dir(adapter) / "config.json" == config and config.stat().st_mtime_ns == made
    os.utime(adapter / "adapter_model.safetensors", ns=(made + 10**9, made + 10**9))  # trained on since
    merged_adapter_dir(adapter)
    assert config.stat().st_mtime_ns != made


def test_a_merge_whose_adapter_weights_are_gone_is_used_as_it_is(tiny_model_dir, tmp_path):
    """`<adapter>-merged` beside an adapter directory that no longer holds its weights (kept only for
    its config and tokenizer) is used as it is, however old it looks (a copy that kept no times: 1970)."""
    from tirl.rl.lora import merged_adapter_dir

    _, adapter = _adapter(tiny_model_dir, tmp_path)
    config = merged_adapter_dir(adapter) / "config.json"
    (adapter / "adapter_model.safetensors").unlink()
    os.utime(config, (0, 0))
    assert merged_adapter_dir(adapter) / "config.json" == config and config.stat().st_mtime == 0


def test_an_adapter_with_a_link_leading_outside_or_a_broken_base_is_one_line_and_merges_nothing(
    tiny_model_dir, tmp_path
):
    """The merge copies the adapter's other files beside the model: a link in it leading outside is
    refused, naming the adapter; a base that is there but does not load is one line naming both."""
    from tirl.rl.lora import merge_adapter

    base, adapter = _adapter(tiny_model_dir, tmp_path)
    (tmp_path / "secret").write_text("not the model's")
    (adapter / "tokenizer_extra.json").symlink_to(tmp_path / "secret")
    with pytest.raises(ValueError) as raised:
        merge_adapter(adapter, tmp_path / "merged")
    assert str(raised.value).startswith(f"adapter {adapter}: ") and "\n" not in str(raised.value)
    (adapter / "tokenizer_extra.json").unlink()
    (base / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as raised:
        merge_adapter(adapter, tmp_path / "merged")
    said = str(raised.value)
    assert said.startswith(f"{adapter}: cannot load its base model '{base.resolve()}': ") and "\n" not in said
    assert not (tmp_path / "merged").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no build left behind
