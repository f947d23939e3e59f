"""`LocalLearner`: the policy in this process (one of the torchrun ranks under FSDP2: every rank calls
the same methods in the same order). Each Ray trainer worker (tirl.rl.ray_learner) holds one too."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tirl.distributed.groups import DistInfo, full_model_state
from tirl.rl.lora import merged_tensors
from tirl.rl.policy import Policy, TrainSample
from tirl.rl.update import grpo_update

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tirl.rl.config import AlgorithmConfig
    from tirl.runtime.base import Runtime


class LocalLearner:
    """The policy in this process; under torchrun each rank holds one and they act together."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.sync_names = {n for n, _ in policy.model.named_parameters()}  # a tied head travels once

    @property
    def info(self) -> DistInfo:
        return self.policy.info

    def update(self, samples: list[TrainSample], alg: AlgorithmConfig) -> dict[str, Any]:
        metrics = grpo_update(self.policy, samples, alg)
        self.policy.advance_schedule()
        return metrics | {"train/lr": self.policy.lr}

    def sync_weights(self, runtime: Runtime | None) -> dict[str, float]:
        if self.policy.lora:
            return self._sync_merged(runtime)
        state = full_model_state(self.policy.model, self.info)  # a collective under FSDP
        if runtime is not None:
            runtime.load_weights((k, v) for k, v in state.items() if k in self.sync_names)
        return {}

    def _sync_merged(self, runtime: Runtime | None) -> dict[str, float]:
        """LoRA: the engines get the merged weights of the layers the adapters touch (W + s B A under
        the base names; tirl.rl.lora.merged_tensors), nothing else: the rest of the base never changes."""
        pairs, nbytes = [], 0
        for name, lazy in merged_tensors(self.policy.model):
            tensor = lazy.make()  # an all-gather under FSDP: every rank makes every tensor
            if runtime is not None:
                pairs.append((name, tensor.cpu()))
                nbytes += tensor.numel() * tensor.element_size()
        if runtime is not None:
            runtime.load_weights(pairs)
        return {"sync/tensors": float(len(pairs)), "sync/bytes": float(nbytes)}

    def offload(self, what: str = "all") -> bool:
        """Colocated engines run in this rank's GPU memory meanwhile: the optimizer state ("optimizer",
        after an update), the parameters ("params", after the sync) or both go to host memory and the
        cache is handed back to CUDA. On CPU there is nothing to free (False)."""
        policy = self.policy
        if policy.device.type != "cuda":
            return False
        if what in ("all", "optimizer"):
            policy.optimizer.zero_grad(set_to_none=True)
            _move_optimizer_state(policy.optimizer, torch.device("cpu"))
        if what in ("all", "params"):
            policy.model.to("cpu")  # FSDP2 re-points its sharded parameters on .to()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return True

    def onload(self) -> bool:
        """Parameters and optimizer state back on the GPU before an update (no-op where resident)."""
        policy = self.policy
        if policy.device.type != "cuda":
            return False
        policy.model.to(policy.device)
        _move_optimizer_state(policy.optimizer, policy.device)
        return True

    def reset_optimizer(self, total_steps: int) -> None:
        self.policy.reset_optimizer(total_steps)

    def snapshot_reference(self) -> None:
        self.policy.snapshot_reference()

    def restore(self, saved: dict) -> None:
        self.policy.restore(saved)

    def save(
        self, run_dir: Path, step: int, tokenizer: PreTrainedTokenizerBase | None, state: dict, keep_last: int
    ) -> None:
        self.policy.save(run_dir, step, tokenizer, state, keep_last)


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != device:
                state[key] = value.to(device, non_blocking=True)
