"""The learner seam: where the policy's updates run, as seen from `rl_step`.

`LocalLearner` is the policy in this process (one of the torchrun ranks under FSDP2: every rank
calls the same methods in the same order). `tirl.runtime.ray_learner.RayLearner` drives one trainer worker
actor per rank, each holding a `LocalLearner` of its own in a torch.distributed group; the driver
keeps running `rl_step` top to bottom and calls them for log-probs, updates, sync and checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tirl.rl.distributed import DistInfo, full_model_state
from tirl.rl.policy import Policy, TrainSample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tirl.rl.config import AlgorithmConfig
    from tirl.runtime.base import Runtime


class Learner(Protocol):
    def update(self, samples: list[TrainSample], alg: AlgorithmConfig) -> dict[str, Any]:
        """Old log-probs, GRPO updates (one per mini-batch), the LR schedule's step; the metrics."""
        ...

    def sync_weights(self, runtime: Runtime | None) -> dict[str, float]:
        """The engines of `runtime` sample from the updated policy from now on."""
        ...

    def reset_optimizer(self, total_steps: int) -> None: ...

    def snapshot_reference(self) -> None: ...

    def restore(self, saved: dict) -> None: ...

    def save(
        self, run_dir: Path, step: int, tokenizer: PreTrainedTokenizerBase | None, state: dict, keep_last: int
    ) -> None: ...


class LocalLearner:
    """The policy in this process; under torchrun each rank holds one and they act together."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.sync_names = {n for n, _ in policy.model.named_parameters()}  # a tied head travels once

    @property
    def info(self) -> DistInfo:
        return self.policy.info

    def update(self, samples: list[TrainSample], alg: AlgorithmConfig) -> dict[str, Any]:
        from tirl.rl.trainer import grpo_update

        metrics = grpo_update(self.policy, samples, alg)
        self.policy.advance_schedule()
        return metrics | {"train/lr": self.policy.lr}

    def sync_weights(self, runtime: Runtime | None) -> dict[str, float]:
        state = full_model_state(self.policy.model, self.info)  # a collective under FSDP
        if runtime is not None:
            runtime.load_weights((k, v) for k, v in state.items() if k in self.sync_names)
        return {}

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
