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


def _checksum(policy) -> float:
    from tirl.distributed.groups import full_model_state

    state = full_model_state(policy.model, policy.info)
    return float(sum(v.double().abs().sum() for v in state.values())) if policy.info.is_main else 0.0


class _Recorder:
    """Which checkpoint files this rank reads (per state key), and every Module.to() of a module that
    still has unsharded (plain, non-meta) parameters: FSDP must never move a whole model to a device."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, str]] = []
        self.unsharded_moves: list[str] = []

    def __enter__(self):
        import torch
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        self._read, self._to = FileSystemReader.read_data, torch.nn.Module.to
        rec = self

        def read_data(reader, plan, planner):
            for item in plan.items:
                rec.reads.append((item.dest_index.fqn, reader.storage_data[item.storage_index].relative_path))
            return rec._read(reader, plan, planner)

        def to(module, *args, **kwargs):
            plain = [p for p in module.parameters() if not hasattr(p, "to_local") and p.device.type != "meta"]
            if plain:
                rec.unsharded_moves.append(type(module).__name__)
            return rec._to(module, *args, **kwargs)

        FileSystemReader.read_data, torch.nn.Module.to = read_data, to
        return self

    def __exit__(self, *exc) -> None:
        import torch
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        FileSystemReader.read_data, torch.nn.Module.to = self._read, self._to


def run_resume(model_dir: str, run_dir: str) -> dict:
    """An update, a checkpoint, a second update; then a new policy resumed from the checkpoint runs the
    same second update. Records what each rank read on resume and any unsharded model moves."""
    from tirl.distributed.groups import init_distributed
    from tirl.rl.checkpoint import latest_checkpoint, load_trainer_state
    from tirl.rl.config import AlgorithmConfig, OptimConfig
    from tirl.rl.policy import Policy
    from tirl.rl.update import grpo_update

    info = init_distributed("cpu")
    optim = OptimConfig(lr=1e-3, warmup_steps=3, micro_batch_tokens=40, device="cpu")
    alg = AlgorithmConfig(mini_batches=2)
    with _Recorder() as build:
        first = Policy(model_dir, optim, info, total_steps=4)
    vocab = first.model.config.vocab_size
    grpo_update(first, fixed_samples(vocab, n=6, seed=0), alg)  # moments and schedule are under way
    first.advance_schedule()
    first.save(run_dir, 2, None, {"step": 2}, keep_last=2)
    continued = grpo_update(first, fixed_samples(vocab, n=6, seed=2), alg)["train/loss"]
    ckpt = latest_checkpoint(run_dir)
    saved = load_trainer_state(ckpt)
    with _Recorder() as resume:
        second = Policy(str(ckpt / "model"), optim, info, total_steps=4)
        second.restore(saved)
    resumed = grpo_update(second, fixed_samples(vocab, n=6, seed=2), alg)["train/loss"]
    return {
        "rank": info.rank,
        "world": info.world_size,
        "losses": [continued, resumed],
        "checksums": [_checksum(first), _checksum(second)],
        "reads": resume.reads,
        "unsharded_moves": build.unsharded_moves + resume.unsharded_moves,
        "trainer_state_keys": sorted(saved),
    }


if __name__ == "__main__":
    from tirl.distributed.groups import shutdown_distributed

    if sys.argv[1] == "resume":
        result = run_resume(sys.argv[2], sys.argv[3])
        with open(f"{sys.argv[4]}.{result['rank']}", "w") as f:
            json.dump(result, f)
    else:
        result = run_updates(sys.argv[1])
        if result["rank"] == 0:
            with open(sys.argv[2], "w") as f:
                json.dump(result, f)
    shutdown_distributed(synchronize=True)
