"""The learner seam: where the policy's updates run, as seen from `rl_step`, and the one place that
opens one (`open_learner`), so the trainer names no backend.

`LocalLearner` (tirl.rl.local_learner) is the policy in this process (one per torchrun rank).
`RayLearner` (tirl.rl.ray_learner) drives one trainer worker actor per rank, each holding a
`LocalLearner` of its own in a torch.distributed group; the driver keeps running `rl_step` top to
bottom and calls them for log-probs, updates, sync and checkpoints.

A learner names no transport: the runtime's handoff (tirl.runtime.handoff) decides when its state moves
(`offload`, `onload`), how the engines sleep from what its sync carries (`sends`), and how a sync
reaches the engines, from what the learner offers (`LocalLearner.sync_tensors`, `RayLearner.workers`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tirl.distributed.groups import DistInfo
    from tirl.distributed.weight_sync import SyncKind
    from tirl.rl.config import AlgorithmConfig, TrainConfig
    from tirl.rl.policy import TrainSample
    from tirl.runtime.ray_cluster import Placement


class Learner(Protocol):
    sends: SyncKind  # what each sync carries: every weight, or the LoRA-merged adapted layers

    def update(self, samples: list[TrainSample], alg: AlgorithmConfig) -> dict[str, Any]:
        """Old log-probs, GRPO updates (one per mini-batch), the LR schedule's step; the metrics."""
        ...

    def offload(self, what: str = "all") -> bool:
        """The optimizer state ("optimizer"), the parameters ("params") or both ("all") off the
        devices, their memory handed back (colocated engines use it); False where nothing was freed."""
        ...

    def onload(self) -> bool:
        """Parameters and optimizer state back on the devices (no-op where resident)."""
        ...

    def reset_optimizer(self, total_steps: int) -> None: ...

    def snapshot_reference(self) -> None: ...

    def restore(self, saved: dict) -> None: ...

    def stage_checkpoint(self, run_dir: Path, step: int) -> None:
        """Every rank's shards and the model export into a staging directory (the state on its devices)."""
        ...

    def publish_checkpoint(
        self, run_dir: Path, step: int, tokenizer: PreTrainedTokenizerBase | None, state: dict, keep_last: int
    ) -> None:
        """The staged checkpoint with the trainer's `state`, moved into place (host memory only)."""
        ...


@asynccontextmanager
async def open_learner(
    cfg: TrainConfig, model_path: str, info: DistInfo, total_steps: int, placement: Placement | None
) -> AsyncIterator[Learner]:
    """The policy in this process (no placement: cluster.backend=local, one per torchrun rank), or one
    Ray trainer worker per cluster.trainer.ranks in the placement's trainer slots (backend=ray)."""
    if placement is not None:
        from tirl.rl.ray_learner import open_ray_learner

        async with open_ray_learner(cfg, model_path, total_steps, placement) as learner:
            yield learner
    else:
        from tirl.rl.local_learner import LocalLearner
        from tirl.rl.policy import Policy

        yield LocalLearner(Policy(model_path, cfg.optim, info, total_steps))
