"""Configs of `tirl train` (TrainConfig) and `tirl sft` (SFTConfig); YAML + dotted overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tirl.agent.config import AgentConfig
from tirl.engines.config import EngineConfig
from tirl.reward import RewardConfig
from tirl.runtime.config import ClusterConfig
from tirl.sandbox import SandboxConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AlgorithmConfig(_Strict):
    """GRPO-RoC (docs/method.md §3). Objective choices are names of the registries in tirl.rl.advantages and
    tirl.rl.losses, or `module:function` paths to your own."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    prompts_per_step: int = Field(512, ge=1)
    group_size: int = Field(16, ge=1)  # G: rollouts trained on per prompt
    oversample: int = Field(2, ge=1)  # RoC draws oversample*G rollouts and keeps G (1 rollout set when off)
    roc: Literal["sample", "sample_finite", "topk", "off"] = "sample"  # see tirl.rl.roc; off = plain GRPO
    roc_min_per_class: int = Field(0, ge=0)  # the release keeps >= 2 of each class
    drop_uniform_groups: bool = False  # drop groups whose rewards are all equal before RoC
    no_tool_p_err: float = 0.5  # p_err of a trajectory without tool calls
    advantage: str = "grpo"  # grpo (the paper: (r - mean) / std), dr_grpo (r - mean)
    policy_loss: str = "grpo"  # grpo (token ratio, the paper), gspo (sequence ratio)
    eps_low: float = Field(0.2, ge=0.0)
    eps_high: float = Field(0.28, ge=0.0)
    dual_clip: float | None = Field(
        None, gt=1.0
    )  # bound -rho*A of negative-advantage tokens (off: the paper)
    loss_normalization: str = "token"  # token (the paper), sequence, constant (Dr.GRPO, / loss_constant)
    loss_constant: int = Field(8192, ge=1)  # tokens per trajectory the "constant" normalization divides by
    kl_coef: float = 0.0  # no KL term by default (the paper)
    entropy_coef: float = 0.0  # no entropy bonus by default (it caused collapse)
    mini_batches: int = Field(1, ge=1)  # optimizer updates per RL step
    # Truncated importance sampling against the engine's sampling log-probs (tirl.rl.importance): each
    # trained token's loss is weighted by min(pi_old / pi_engine, tis_cap). None (the paper): off.
    # The literature's cap is 2.0; use it with `async` or with engines whose numerics differ (bf16).
    tis_cap: float | None = Field(None, ge=1.0)
    # Asynchronous GRPO-RoC (tirl.rl.async_rollout): the engines keep generating the next steps' groups
    # while the trainer updates; a group whose oldest token is more than max_staleness policy versions
    # behind the trainer is dropped and its prompt re-queued. async=false (the paper): strictly
    # on-policy steps; max_staleness is then ignored (0), and async with max_staleness=0 is the same step.
    async_: bool = Field(False, alias="async")
    max_staleness: int = Field(1, ge=0)

    @field_validator("advantage")
    @classmethod
    def _known_advantage(cls, v: str) -> str:
        from tirl.rl.advantages import resolve_advantage

        resolve_advantage(v)
        return v

    @field_validator("policy_loss")
    @classmethod
    def _known_policy_loss(cls, v: str) -> str:
        from tirl.rl.losses import resolve_policy_loss

        resolve_policy_loss(v)
        return v

    @field_validator("loss_normalization")
    @classmethod
    def _known_normalization(cls, v: str) -> str:
        from tirl.rl.losses import resolve_aggregation

        resolve_aggregation(v)
        return v

    @property
    def staleness_bound(self) -> int:
        """k: how many policy versions behind the trainer a trained token may be (0 when synchronous)."""
        return self.max_staleness if self.async_ else 0

    @property
    def rollouts_per_prompt(self) -> int:
        return self.group_size if self.roc == "off" else self.group_size * self.oversample


class OptimConfig(_Strict):
    lr: float = 1e-6
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(20, ge=0)  # RL: linear warm-up over this many steps
    warmup_ratio: float | None = None  # SFT: warm-up as a fraction of all steps (overrides warmup_steps)
    min_lr_ratio: float = 0.0  # cosine floor
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    micro_batch_tokens: int = Field(16384, ge=1)  # padded tokens per forward/backward
    gradient_checkpointing: bool = False
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 compute on GPU, fp32 on CPU
    device: str = "auto"


class StageConfig(_Strict):
    """One curriculum stage; the optimizer (and the KL reference) are reset when it starts."""

    name: str = "stage"
    steps: int = Field(ge=1)
    data: str  # tirl.data.load_problems name or path
    data_limit: int | None = None
    max_response_tokens: int | None = None  # overrides agent.max_response_tokens
    max_turns: int | None = None  # overrides agent.max_turns


class CheckpointConfig(_Strict):
    every: int = Field(50, ge=1)  # steps between checkpoints (and one at the end of each stage)
    keep_last: int = Field(3, ge=1)


class LoggingConfig(_Strict):
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "tirl"
    alert_tool_error_rate: float = 0.5  # alert when the step's tool error ratio exceeds this ...
    alert_spike_factor: float = 2.0  # ... or jumps this many times above its running mean
    alert_sandbox_failure_rate: float = 0.05  # infra failures (sandbox_error) per tool call
    alert_min_calls: int = 20  # no alert on a step with fewer tool calls (ratios of a few calls are noise)
    # Trajectories per RL step written to RUN/trajectories.jsonl for `tirl view` (kept and dropped, with
    # RoC's penalties and advantages; no token ids). 0 writes none.
    trajectories_per_step: int = Field(8, ge=0)


class TrainConfig(_Strict):
    model: str  # the initial policy (usually the SFT checkpoint): an HF directory
    output_dir: str = "runs"
    run_name: str = "train"
    seed: int = 0
    cluster: ClusterConfig = ClusterConfig()  # where engines, trainer ranks and sandboxes run
    engine: EngineConfig = EngineConfig()
    agent: AgentConfig = AgentConfig()
    sandbox: SandboxConfig = SandboxConfig()
    reward: RewardConfig = RewardConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    optim: OptimConfig = OptimConfig()
    stages: list[StageConfig] = Field(min_length=1)
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    rollout_concurrency: int = Field(256, ge=1)

    @model_validator(mode="after")
    def _engine_serves_the_policy(self) -> TrainConfig:
        if not self.engine.model:
            self.engine = self.engine.model_copy(update={"model": self.model})
        return self

    @model_validator(mode="after")
    def _async_engines_stay_awake(self) -> TrainConfig:
        if self.algorithm.async_ and (self.engine.enable_sleep_mode or self.cluster.colocate):
            raise ValueError(
                "algorithm.async keeps the engines generating while the trainer updates, so they cannot "
                "sleep nor share the trainer's GPUs: set engine.enable_sleep_mode=false and "
                "cluster.colocate=false (engines and trainer ranks on their own GPUs)"
            )
        return self

    @model_validator(mode="after")
    def _tis_compares_like_with_like(self) -> TrainConfig:
        # The engine reports log-probs of its sampling distribution (tempered, nucleus-renormalized); the
        # trainer's are of the plain softmax: the TIS ratio is only an importance weight when they agree.
        if self.algorithm.tis_cap is not None and (self.agent.temperature != 1.0 or self.agent.top_p != 1.0):
            raise ValueError(
                f"algorithm.tis_cap needs agent.temperature=1.0 and agent.top_p=1.0 (got "
                f"{self.agent.temperature}, {self.agent.top_p}): the engine's log-probs would be of another "
                "distribution than the trainer's; set them to 1.0 or turn tis_cap off"
            )
        return self

    @model_validator(mode="after")
    def _colocation_fits(self) -> TrainConfig:
        cluster, engine = self.cluster, self.engine
        if not cluster.colocate:
            return self
        if engine.num_engines != cluster.trainer.ranks:
            raise ValueError(
                f"cluster.colocate pairs engine i with trainer rank i on one device, but engine.num_engines="
                f"{engine.num_engines} and cluster.trainer.ranks={cluster.trainer.ranks}: make them equal"
            )
        if engine.backend == "vllm" and cluster.engines.num_gpus > 0 and not engine.enable_sleep_mode:
            raise ValueError(
                "cluster.colocate on GPUs with vLLM: set engine.enable_sleep_mode=true, or the engine keeps "
                "engine.gpu_memory_utilization of the GPU its trainer rank needs while it trains"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name

    @property
    def total_steps(self) -> int:
        return sum(s.steps for s in self.stages)


class SFTConfig(_Strict):
    """Stage 0: non-reasoning SFT (docs/method.md §4): loss on assistant tokens only, cosine schedule."""

    model: str
    data: list[str] = Field(min_length=1)  # chat-format JSONL files (see tirl.rl.sft)
    output_dir: str = "runs"
    run_name: str = "sft"
    seed: int = 0
    epochs: int = Field(3, ge=1)
    batch_size: int = Field(128, ge=1)  # sequences per optimizer step
    max_length: int = Field(4096, ge=8)  # longer examples are truncated (and counted)
    optim: OptimConfig = OptimConfig(lr=5e-6, schedule="cosine", warmup_ratio=0.04, weight_decay=0.0)
    checkpoint: CheckpointConfig = CheckpointConfig(every=500)
    logging: LoggingConfig = LoggingConfig()
    # The agent protocol the data is written in (prompt, tool schema, template): saved with every
    # checkpoint so that `tirl eval`/`tirl chat` prompt the model the way it was trained. SFT itself reads
    # the rendered examples and does not use it.
    agent: AgentConfig | None = None

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_name
