"""A resumed LoRA run merges its checkpoint's adapter (a fp32 copy of the whole model on the host,
59 GB at 14B) only in the process that opens the engines, rank 0: the trainer of every rank starts
from the frozen base and reads its adapter from the shards (issue 41, "Also")."""

from __future__ import annotations

from pathlib import Path

import torch
from tests.train_config import write_train_config

from tirl.config import load_config
from tirl.rl.config import TrainConfig
from tirl.rl.lora import ADAPTER_DIR, MERGED_DIR, apply_lora, save_adapter
from tirl.rl.trainer import resolve_model_paths

CPU = torch.device("cpu")


def _lora_checkpoint(model_dir: Path, ckpt: Path, cfg: TrainConfig) -> None:
    from transformers import AutoModelForCausalLM

    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir), cfg.optim.lora)
    save_adapter(model, ckpt / ADAPTER_DIR, str(model_dir), is_main=True)


def test_a_resumed_lora_run_trains_from_the_base_and_serves_the_merged_checkpoint(tiny_model_dir, tmp_path):
    """What rank 0 resolves (and every other rank takes from it: model_paths, tests/rl/rank_zero_worker.py)."""
    path = write_train_config(tmp_path, tiny_model_dir)
    cfg = load_config(TrainConfig, path, ["optim.lora.enabled=true", "optim.lora.target_modules=q_proj"])
    ckpt = tmp_path / "checkpoints" / "step_1"
    _lora_checkpoint(tiny_model_dir, ckpt, cfg)
    base = str(tiny_model_dir)
    policy, engines = resolve_model_paths(cfg, ckpt)
    assert (
        policy == base and engines == str(ckpt / MERGED_DIR) and (ckpt / MERGED_DIR / "config.json").is_file()
    )


def test_the_preflight_merges_nothing_off_rank_zero(tiny_model_dir, tmp_path, monkeypatch):
    """Issue 68, fix 2: `tirl train` runs the preflight on every torchrun rank before the process group
    exists; under RANK=1 it reads and merges nothing (rank 0 checks for all: torchrun stops the others
    when it fails). Here `model:` is a LoRA SFT adapter and the run resumes from a LoRA checkpoint: two
    merges rank 0 makes, rank 1 none."""
    from tirl.rl.preflight import preflight_train

    adapter = tmp_path / "sft-adapter"
    base_cfg = load_config(
        TrainConfig,
        write_train_config(tmp_path, tiny_model_dir),
        ["optim.lora.enabled=true", "optim.lora.target_modules=q_proj"],
    )
    _lora_checkpoint(tiny_model_dir, adapter.parent / "sft" / "ckpt", base_cfg)
    adapter = adapter.parent / "sft" / "ckpt" / ADAPTER_DIR
    path = write_train_config(tmp_path, adapter)
    cfg = load_config(TrainConfig, path, ["optim.lora.enabled=true", "optim.lora.target_modules=q_proj"])
    ckpt = cfg.run_dir / "checkpoints" / "step_000001"
    _lora_checkpoint(tiny_model_dir, ckpt, cfg)
    monkeypatch.setenv("RANK", "1")
    assert preflight_train(cfg, resume=True) == []
    assert not (ckpt / MERGED_DIR).exists() and not adapter.with_name(adapter.name + "-merged").exists()
