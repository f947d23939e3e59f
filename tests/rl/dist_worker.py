"""GRPO updates on a fixed batch: run alone or under torchrun; writes the losses and a weight checksum.

torchrun --nproc_per_node=2 tests/rl/dist_worker.py MODEL_DIR OUT.json
"""

from __future__ import annotations

import json
import sys

import numpy as np


def fixed_samples(vocab: int, n: int = 10, seed: int = 0):
    from tirl.rl.policy import TrainSample

    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        prompt, resp = int(rng.integers(3, 8)), int(rng.integers(2, 20))
        ids = rng.integers(5, vocab, prompt + resp).tolist()
        mask = [0] * (prompt - 1) + rng.choice([0, 1], resp, p=[0.2, 0.8]).tolist()
        samples.append(TrainSample(ids, mask, float(rng.normal())))
    return samples


def run_updates(model_dir: str, steps: int = 3) -> dict:
    import torch

    from tirl.distributed.groups import full_model_state, init_distributed
    from tirl.rl.config import AlgorithmConfig, OptimConfig
    from tirl.rl.policy import Policy
    from tirl.rl.update import grpo_update

    torch.manual_seed(0)
    info = init_distributed("cpu")
    optim = OptimConfig(lr=1e-3, warmup_steps=0, micro_batch_tokens=40, device="cpu")
    policy = Policy(model_dir, optim, info, total_steps=steps)
    alg = AlgorithmConfig(mini_batches=2)
    vocab = policy.model.config.vocab_size
    losses, norms = [], []
    for step in range(steps):
        samples = fixed_samples(vocab, seed=step)
        stats = grpo_update(policy, samples, alg)
        policy.advance_schedule()
        losses.append(stats["train/loss"])
        norms.append(stats["train/grad_norm"])
    state = full_model_state(policy.model, info)
    checksum = float(sum(v.double().abs().sum() for v in state.values())) if info.is_main else 0.0
    return {
        "losses": losses,
        "grad_norms": norms,
        "checksum": checksum,
        "world": info.world_size,
        "rank": info.rank,
    }


if __name__ == "__main__":
    from tirl.distributed.groups import shutdown_distributed

    result = run_updates(sys.argv[1])
    if result["rank"] == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(result, f)
    shutdown_distributed(synchronize=True)
