"""LoRA updates on fixed batches, a checkpoint and a resume: run alone or under torchrun; writes the
losses, what the engines would get (the merged weights) and what the resumed policy computes.

torchrun --nproc_per_node=2 tests/rl/lora_worker.py MODEL_DIR RUN_DIR OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from dist_worker import fixed_samples


def lora_optim():
    from tirl.rl.config import LoraConfig, OptimConfig

    lora = LoraConfig(enabled=True, rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    return OptimConfig(lr=1e-2, warmup_steps=0, micro_batch_tokens=40, device="cpu", lora=lora)


def run(model_dir: str, run_dir: str) -> dict:
    import torch

    from tirl.distributed.groups import init_distributed
    from tirl.rl.checkpoint import latest_checkpoint, load_trainer_state
    from tirl.rl.config import AlgorithmConfig
    from tirl.rl.lora import merged_tensors
    from tirl.rl.policy import Policy
    from tirl.rl.update import grpo_update

    torch.manual_seed(0)
    info = init_distributed("cpu")
    optim, alg = lora_optim(), AlgorithmConfig(mini_batches=2)
    first = Policy(model_dir, optim, info, total_steps=4)
    vocab = first.model.config.vocab_size
    losses = []
    for step in range(2):
        losses.append(grpo_update(first, fixed_samples(vocab, n=6, seed=step), alg)["train/loss"])
        first.advance_schedule()
    first.save(run_dir, 2, None, {"step": 2}, keep_last=2)
    merged = {name: float(t.make().double().abs().sum()) for name, t in merged_tensors(first.model)}
    continued = grpo_update(first, fixed_samples(vocab, n=6, seed=5), alg)["train/loss"]
    second = Policy(model_dir, optim, info, total_steps=4)
    second.restore(load_trainer_state(latest_checkpoint(run_dir)))
    resumed = grpo_update(second, fixed_samples(vocab, n=6, seed=5), alg)["train/loss"]
    return {
        "rank": info.rank,
        "world": info.world_size,
        "losses": losses,
        "merged": merged,
        "continued": continued,
        "resumed": resumed,
        "trainable": sorted(n for n, p in first.model.named_parameters() if p.requires_grad),
    }


if __name__ == "__main__":
    from tirl.distributed.groups import shutdown_distributed

    result = run(sys.argv[1], sys.argv[2])
    if result["rank"] == 0:
        Path(sys.argv[3]).write_text(json.dumps(result))
    shutdown_distributed(synchronize=True)
