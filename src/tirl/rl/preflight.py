"""What the config alone decides, checked before a training run starts anything (engines, Ray, sandboxes):
a prompt longer than engine.max_model_len, a stage's data that cannot be read, a Ray private cluster
smaller than the config's actors, agent settings that differ from the ones the model was trained with.
Each failure is a ConfigError with one line saying what to change; warnings are returned, not raised."""

from __future__ import annotations

import os

from tirl.agent.protocol import check_context
from tirl.config import ConfigError
from tirl.data import DataError, load_problems
from tirl.rl.checkpoint import (
    agent_settings_warning,
    checkpoint_model_dir,
    latest_checkpoint,
    resolve_model_path,
)
from tirl.rl.config import StageConfig, TrainConfig
from tirl.rl.lora import check_lora


def preflight_train(cfg: TrainConfig, resume: bool = False) -> list[str]:
    """Raise ConfigError for what would fail later in `cfg`'s run; return warnings to print. Under
    torchrun only rank 0 reads (and, for a LoRA model or resume, merges) the model: every rank merging
    its own fp32 copy at once was 8 x 59 GB per node at 14B; torchrun stops the others if it fails."""
    if os.environ.get("RANK", "0") != "0":
        _check_cluster(cfg)
        return []
    model_path = _model_path(cfg, resume)
    check_lora(resolve_model_path(cfg.model) if resume else model_path, cfg.optim.lora)
    _check_cluster(cfg)
    from tirl.engines.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    for index, stage in enumerate(cfg.stages):
        problems = _stage_problems(stage, first=index == 0 and not resume)
        if problems:
            check_context(
                tokenizer,
                problems,
                _stage_agent(cfg, stage),
                cfg.engine.max_model_len,
                f"stage {stage.name!r}",
            )
    warning = agent_settings_warning(model_path, cfg.agent)
    return [warning] if warning else []


def _model_path(cfg: TrainConfig, resume: bool) -> str:
    """The model the run starts from: on --resume its newest checkpoint's, else cfg.model's."""
    ckpt = latest_checkpoint(cfg.run_dir) if resume else None
    return str(checkpoint_model_dir(ckpt)) if ckpt else resolve_model_path(cfg.model)


def _stage_agent(cfg: TrainConfig, stage: StageConfig):
    update = {"max_turns": stage.max_turns, "max_response_tokens": stage.max_response_tokens}
    return cfg.agent.model_copy(update={k: v for k, v in update.items() if v is not None})


def _stage_problems(stage: StageConfig, first: bool) -> list:
    """The stage's problems; a later stage's data may not exist yet (the hard set is made after stage
    2 with `tirl data filter-hard`): the trainer reports that when it gets there."""
    try:
        return load_problems(stage.data, limit=stage.data_limit)
    except (DataError, FileNotFoundError) as e:
        if first:
            raise ConfigError(f"stage {stage.name!r}: cannot load its data: {e}") from e
        return []


def _check_cluster(cfg: TrainConfig) -> None:
    """A private Ray with cluster.num_cpus set must hold every actor the run places."""
    try:
        cfg.cluster.check_private_cpus(cfg.engine.num_engines, cfg.cluster.trainer.ranks)
    except ValueError as e:
        raise ConfigError(str(e)) from None


__all__ = ["preflight_train"]
