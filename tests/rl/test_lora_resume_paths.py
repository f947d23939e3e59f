"""A resumed LoRA run merges its checkpoint's adapter (a fp32 copy of the whole model on the host,
59 GB at 14B) only in the process that opens the engines, rank 0: the trainer of every rank starts
from the frozen base and reads its adapter from the shards (issue 41, "Also")."""

from __future__ import annotations

from pathlib import Path

import torch
from tests.train_config import write_train_config

from tirl.config import load_config
from tirl.distributed.groups import DistInfo
from tirl.rl.config import TrainConfig
from tirl.rl.lora import ADAPTER_DIR, MERGED_DIR, apply_lora, save_adapter
from tirl.rl.trainer import model_paths

CPU = torch.device("cpu")


def _lora_checkpoint(model_dir: Path, ckpt: Path, cfg: TrainConfig) -> None:
    from transformers import AutoModelForCausalLM

    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir), cfg.optim.lora)
    save_adapter(model, ckpt / ADAPTER_DIR, str(model_dir), is_main=True)


def test_only_rank_zero_merges_a_resumed_lora_checkpoint(tiny_model_dir, tmp_path):
    path = write_train_config(tmp_path, tiny_model_dir)
    cfg = load_config(TrainConfig, path, ["optim.lora.enabled=true", "optim.lora.target_modules=q_proj"])
    ckpt = tmp_path / "checkpoints" / "step_1"
    _lora_checkpoint(tiny_model_dir, ckpt, cfg)
    base = str(tiny_model_dir)
    assert model_paths(cfg, ckpt, DistInfo(1, 2, CPU)) == (base, base)
    assert not (ckpt / MERGED_DIR).exists()  # rank 1 built no merged copy of the model
    policy, engines = model_paths(cfg, ckpt, DistInfo(0, 2, CPU))
    assert (
        policy == base and engines == str(ckpt / MERGED_DIR) and (ckpt / MERGED_DIR / "config.json").is_file()
    )
