"""Issue 68, fixes 2 and 3: what rank 0 alone does at the start of a torchrun run (merge a LoRA
adapter, read the full model from disk) may take longer than the collective timeout; the other ranks
wait for it at rank 0's gate (the rendezvous store) and merge nothing themselves. Two gloo processes,
a 2 s collective timeout, rank 0 taking 5 s for each (tests/runtime/rank_zero_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.terminal import run_torchrun

WORKER = Path(__file__).with_name("rank_zero_worker.py")


def _adapter(model_dir: Path, out: Path) -> Path:
    """A peft adapter of the tiny model with non-zero B (so its merge changes the weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tirl.rl.config import LoraConfig
    from tirl.rl.lora import apply_lora, save_adapter

    model = apply_lora(
        AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(enabled=True, target_modules=["q_proj"])
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.01)
    save_adapter(model, out, str(model_dir), is_main=True)
    return out


def test_rank_zero_merges_and_reads_past_the_collective_timeout_and_the_run_starts(tiny_model_dir, tmp_path):
    adapter = _adapter(tiny_model_dir, tmp_path / "adapter")
    out = tmp_path / "ranks"
    proc = run_torchrun(WORKER, str(adapter), str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert [r["merges"] for r in ranks] == [[0], []]  # the merge ran on rank 0 only
    assert ranks[0]["path"] == ranks[1]["path"] == str(tmp_path / "adapter-merged")
    assert ranks[0]["sum"] == ranks[1]["sum"]
