"""`LocalLearner`: the policy in this process (one of the torchrun ranks under FSDP2: every rank calls
the same methods in the same order). Each Ray trainer worker (tirl.rl.ray_learner) holds one too."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tirl.distributed.groups import DistInfo
from tirl.distributed.weight_sync import FULL_SYNC, LORA_SYNC, Source, SyncKind
from tirl.rl.lora import merged_tensors
from tirl.rl.policy import Policy, TrainSample
from tirl.rl.update import Shard, grpo_update

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tirl.rl.config import AlgorithmConfig

HOST = torch.device("cpu")  # where offloaded state waits while colocated engines use the GPU


class LocalLearner:
    """The policy in this process; under torchrun each rank holds one and they act together."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.sends: SyncKind = LORA_SYNC if policy.lora else FULL_SYNC

    @property
    def info(self) -> DistInfo:
        return self.policy.info

    @property
    def device(self) -> torch.device:
        """Where this rank trains: where its sync tensors are made (tirl.runtime.handoff.InProcess)."""
        return self.policy.device

    def update(self, samples: list[TrainSample] | Shard, alg: AlgorithmConfig) -> dict[str, Any]:
        """The whole step's batch (every torchrun rank takes its share), or this rank's `Shard` of it
        (a Ray trainer worker: the driver split it)."""
        lr = self.policy.lr  # the rate this update uses (the schedule advances after it)
        metrics = grpo_update(self.policy, samples, alg)
        self.policy.advance_schedule()
        return metrics | {"train/lr": lr}

    def sync_tensors(self) -> dict[str, Source]:
        """What a sync carries (`sends`, decided once), each tensor made when it is sent: every parameter
        (a tied head once), or with LoRA the merged weights of the adapted layers under the base names
        (W + s B A; tirl.rl.lora.merged_tensors), the rest of the base never changing."""
        if self.sends == LORA_SYNC:
            return dict(merged_tensors(self.policy.model))
        return dict(self.policy.model.named_parameters())

    def offload(self, what: str = "all") -> bool:
        """Colocated engines run in this rank's GPU memory meanwhile: the optimizer state ("optimizer",
        after an update), the parameters ("params", after the sync) or both go to host memory and the
        cache is handed back to CUDA. A policy in host memory has nothing to free (False)."""
        policy = self.policy
        if policy.device.type == HOST.type:
            return False
        if what in ("all", "optimizer"):
            policy.optimizer.zero_grad(set_to_none=True)
            _move_optimizer_state(policy.optimizer, HOST)
        if what in ("all", "params"):
            policy.model.to(HOST)  # FSDP2 re-points its sharded parameters on .to()
            if policy.reference is not None:  # the KL reference goes and comes back with the policy
                policy.reference.to(HOST)
        _hand_back_cache(policy.device)
        return True

    def onload(self) -> bool:
        """Parameters and optimizer state back on the GPU before an update (no-op where resident)."""
        policy = self.policy
        if policy.device.type == HOST.type:
            return False
        policy.model.to(policy.device)
        if policy.reference is not None:
            policy.reference.to(policy.device)
        _move_optimizer_state(policy.optimizer, policy.device)
        return True

    def reset_optimizer(self, total_steps: int) -> None:
        self.policy.reset_optimizer(total_steps)

    def snapshot_reference(self) -> None:
        self.policy.snapshot_reference()

    def restore(self, saved: dict) -> None:
        self.policy.restore(saved)

    def stage_checkpoint(self, run_dir: Path, step: int) -> None:
        self.policy.stage_checkpoint(run_dir, step)

    def publish_checkpoint(
        self, run_dir: Path, step: int, tokenizer: PreTrainedTokenizerBase | None, state: dict, keep_last: int
    ) -> None:
        self.policy.publish_checkpoint(run_dir, step, tokenizer, state, keep_last)


def _hand_back_cache(device: torch.device) -> None:
    """What this process freed on `device` goes back to the CUDA driver, for the engines to take."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Every state tensor to `device`, but Adam's `step` counters stay where torch keeps them: on the
    host unless the optimizer is fused or capturable (on the GPU, reading one is a sync per parameter
    at every step)."""
    for group in optimizer.param_groups:
        steps_on_host = not (group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if key == "step" and steps_on_host:
                    continue
                if isinstance(value, torch.Tensor) and value.device != device:
                    optimizer.state[param][key] = value.to(device, non_blocking=True)
