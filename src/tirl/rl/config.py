"""Configs of `tirl train` (TrainConfig) and `tirl sft` (SFTConfig); YAML + dotted overrides."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from tirl.agent.config import AgentConfig
from tirl.engines.config import EngineConfig
from tirl.reward import RewardConfig
from tirl.runtime.config import ClusterConfig
from tirl.sandbox import SandboxConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# The truncation cap of the off-policy correction `algorithm.async` gets unless told otherwise (the
# literature's, Yao et al. 2025; measured on the demo: tirl/docs/results-async.md).
ASYNC_TIS_CAP = 2.0


class UncorrectedAsyncWarning(UserWarning):
    """algorithm.async with the off-policy correction explicitly turned off."""


def uncorrected_async_message(k: int) -> str:
    return (
        f"algorithm.async=true with algorithm.tis_cap=null: NO off-policy correction. Tokens sampled by "
        f"engine weights up to max_staleness={k} versions behind the trainer are trained as if the trainer's "
        "current policy had sampled them (the clipped ratio's pi_old is the trainer's own recomputation), so "
        "every update is biased; on the tiny demo (lr 3e-4) this took held-out accuracy from 60.9% to 0% in "
        "30 steps. Drop the override to get the default truncated importance sampling "
        f"(algorithm.tis_cap={ASYNC_TIS_CAP}), or set algorithm.async=false. Watch train/engine_logprob_gap, "
        "finish/length and the alerts (logging.alert_action=stop ends the run on them)."
    )


class AlgorithmConfig(_Strict):
    """GRPO-RoC (docs/method.md §3). Objective choices are names of the registries in tirl.rl.advantages and
    tirl.rl.losses, or `module:function` paths to your own."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    prompts_per_step: int = Field(512, ge=1)
    group_size: int = Field(16, ge=1)  # G: rollouts trained on per prompt
    oversample: int = Field(2, ge=1)  # RoC draws oversample*G rollouts and keeps G (1 rollout set when off)
    roc: Literal["sample", "topk", "off"] = "sample"  # see tirl.rl.roc; off = plain GRPO
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
    # Unset with `async` and max_staleness >= 1, it becomes ASYNC_TIS_CAP (2.0, the literature's cap);
    # `tis_cap: null` (or "off") there opts out, with a warning. Also useful with engines whose numerics
    # differ from the trainer's (bf16 vLLM on GPUs).
    tis_cap: float | None = Field(None, ge=1.0)
    # Asynchronous GRPO-RoC (tirl.rl.async_rollout): the engines keep generating the next steps' groups
    # while the trainer updates; a group whose oldest token is more than max_staleness policy versions
    # behind the trainer is dropped and its prompt re-queued. async=false (the paper): strictly
    # on-policy steps; max_staleness is then ignored (0), and async with max_staleness=0 is the same step.
    async_: bool = Field(False, alias="async")
    max_staleness: int = Field(1, ge=0)
    # bounded: a trained token is AT MOST max_staleness versions old (the first complete groups are taken,
    # syncs land mid-generation): fastest, but timing decides the pattern. exact: step t trains on groups
    # generated entirely by version t - k (max(t - k, 0) in a stage's first k steps): syncs wait for the
    # groups ahead, so a seed reproduces the run's staleness pattern (tests, studies, replaying a collapse).
    staleness_mode: Literal["bounded", "exact"] = "bounded"
    _tis_defaulted: bool = PrivateAttr(False)  # tis_cap came from the async default, not from the user

    @field_validator("tis_cap", mode="before")
    @classmethod
    def _tis_off(cls, v: Any) -> Any:
        return None if isinstance(v, str) and v.strip().lower() in ("off", "none", "null") else v

    @model_validator(mode="after")
    def _async_is_corrected(self) -> AlgorithmConfig:
        """Async with staleness gets the off-policy correction unless the user set tis_cap (null: opt out)."""
        if not self.async_ or self.max_staleness == 0:
            return self  # k = 0 is the synchronous step exactly: nothing is off-policy
        if "tis_cap" not in self.model_fields_set:
            self.tis_cap = ASYNC_TIS_CAP
            self._tis_defaulted = True
        elif self.tis_cap is None:
            warnings.warn(
                uncorrected_async_message(self.max_staleness), UncorrectedAsyncWarning, stacklevel=2
            )
        return self

    @property
    def tis_defaulted(self) -> bool:
        """Whether tis_cap is the async default (the user did not choose it)."""
        return self._tis_defaulted

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
    def exact_staleness(self) -> bool:
        """Every step trains on one exact version (staleness_mode exact; trivially so when synchronous)."""
        return self.async_ and self.staleness_mode == "exact"

    @property
    def staleness_bound(self) -> int:
        """k: how many policy versions behind the trainer a trained token may be (0 when synchronous)."""
        return self.max_staleness if self.async_ else 0

    @property
    def rollouts_per_prompt(self) -> int:
        return self.group_size if self.roc == "off" else self.group_size * self.oversample


class LoraConfig(_Strict):
    """LoRA adapters (peft, `pip install 'tirl[lora]'`): only the adapters train, the base stays frozen
    (bf16 on GPUs); the engines get the merged weights of the adapted layers after every step
    (docs/lora.md)."""

    enabled: bool = False
    rank: int = 16  # r
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = Field(0.0, ge=0.0, lt=1.0)  # on the adapter's input; SFT only (RL needs exact log-probs)
    # Leaf module names (q_proj, v_proj, ...) or "all-linear" (every linear layer but the output head);
    # checked against the model's real modules before a run starts.
    target_modules: list[str] = Field(default_factory=lambda: ["all-linear"], min_length=1)
    init_seed: int = 0  # the adapters' initialization (A random, B zero): the same in every run

    @field_validator("rank")
    @classmethod
    def _positive_rank(cls, v: int) -> int:
        if v <= 0:
            raise ValueError(f"the LoRA rank must be a positive integer (8, 16, 64, ...), got {v}")
        return v

    @field_validator("target_modules", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, v: Any) -> Any:
        return [s.strip() for s in v.split(",") if s.strip()] if isinstance(v, str) else v


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
    lora: LoraConfig = LoraConfig()  # optim.lora.enabled=true trains LoRA adapters only


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
    # The model giving up its tool (a silent failure of tool RL: the reward can still rise): an alert when
    # tool calls per trajectory fall below this fraction of their mean over the run's first 3 steps, or
    # below the floor. Every step is watched, however few its calls. None turns one off.
    alert_tool_use_drop: float | None = Field(0.5, gt=0, lt=1)
    alert_tool_use_floor: float | None = Field(None, gt=0)
    # A model that writes its own <tool_response> frames (made-up tool output, trained on as if the tool
    # had said it unless agent.stop_at_forged_observation): an alert when the share of a step's
    # trajectories with one exceeds this. None turns it off.
    alert_forged_observation_share: float | None = Field(0.05, gt=0, lt=1)
    # Off-policy guard rails (what moved when async without correction collapsed: docs/results-async.md).
    # Each alerts when the step's value exceeds it; None turns that one off.
    alert_engine_logprob_gap: float | None = Field(0.05, gt=0)  # mean |engine - trainer| log-prob per token
    alert_length_limit_share: float | None = Field(0.5, gt=0)  # share of rollouts cut by the length limit
    alert_tis_truncated_frac: float | None = Field(0.05, gt=0)  # tokens whose TIS weight hit the cap
    alert_ratio_max: float | None = Field(None, gt=1)  # largest per-token pi / pi_old (spiky: off)
    alert_approx_kl: float | None = Field(0.1, gt=0)  # mean approx KL(pi_old || pi) per token of the update
    # What an alert does: warn (printed, and listed under "alerts" in metrics.jsonl), or stop the run once
    # alert_stop_after consecutive steps alerted, naming the newest checkpoint from before those steps.
    alert_action: Literal["warn", "stop"] = "warn"
    alert_stop_after: int = Field(2, ge=1)
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
        alg, agent = self.algorithm, self.agent
        if alg.tis_cap is None or (agent.temperature == 1.0 and agent.top_p == 1.0):
            return self
        why = (
            f"algorithm.async with max_staleness={alg.max_staleness} turns on the off-policy correction "
            f"(truncated importance sampling, algorithm.tis_cap={alg.tis_cap}) by default, and it"
            if alg.tis_defaulted
            else f"algorithm.tis_cap={alg.tis_cap} (truncated importance sampling)"
        )
        raise ValueError(
            f"{why} needs agent.temperature=1.0 and agent.top_p=1.0, got {agent.temperature} and "
            f"{agent.top_p}. Its weight is pi_trainer(token) / pi_engine(token), and the engine reports the "
            "log-prob of the distribution it sampled from (logits / temperature, renormalized over the top-p "
            "nucleus) while the trainer computes the plain softmax: with any other temperature or top_p the "
            "two are different distributions even with identical weights, and the weight measures that "
            "difference instead of the policy's staleness. Set agent.temperature=1.0 and agent.top_p=1.0, "
            "or turn the correction off with algorithm.tis_cap=null"
            + (" (uncorrected async updates are biased: a warning says more)" if alg.async_ else "")
        )

    @model_validator(mode="after")
    def _lora_is_deterministic(self) -> TrainConfig:
        lora = self.optim.lora
        if lora.enabled and lora.dropout > 0:
            raise ValueError(
                f"optim.lora.dropout={lora.dropout}: RL needs dropout off (the ratio pi / pi_old and the engine "
                "log-prob gap compare deterministic log-probs); set optim.lora.dropout=0 (dropout is for tirl sft)"
            )
        return self

    @model_validator(mode="after")
    def _tensor_parallel_engines_get_their_gpus(self) -> TrainConfig:
        """On Ray a tensor-parallel vLLM engine is one actor holding all its GPUs (one bundle; vLLM's
        multiprocessing executor starts a worker per GPU there)."""
        engine, gpus = self.engine, self.cluster.engines.num_gpus
        tp = engine.tensor_parallel_size
        if self.cluster.backend == "ray" and engine.backend == "vllm" and gpus > 0 and gpus != tp:
            raise ValueError(
                f"engine.tensor_parallel_size={tp} runs each vLLM engine on {tp} GPUs, but "
                f"cluster.engines.num_gpus={gpus:g} gives each engine actor that many: make them equal"
            )
        return self

    @model_validator(mode="after")
    def _colocation_fits(self) -> TrainConfig:
        cluster, engine = self.cluster, self.engine
        if cluster.colocate and engine.num_engines != cluster.trainer.ranks:
            raise ValueError(
                f"cluster.colocate pairs engine i with trainer rank i on one device, but engine.num_engines="
                f"{engine.num_engines} and cluster.trainer.ranks={cluster.trainer.ranks}: make them equal"
            )
        lending = cluster.colocated and not self.algorithm.async_
        if lending and engine.backend == "vllm" and self._engines_on_gpus() and not engine.enable_sleep_mode:
            where = "cluster.colocate" if cluster.colocate else "cluster.backend=local (engine i on cuda:i)"
            raise ValueError(
                f"{where} shares the trainer's GPUs with vLLM engines: set engine.enable_sleep_mode=true, or "
                "the engine keeps engine.gpu_memory_utilization of the GPU its trainer rank needs while it trains"
            )
        return self

    def _engines_on_gpus(self) -> bool:
        """Whether the engines run on GPUs: Ray gives them GPUs by cluster.engines.num_gpus; in-process
        (backend=local) they take engine.device, "auto" meaning a GPU where this machine has one."""
        if self.cluster.backend == "ray":
            return self.cluster.engines.num_gpus > 0
        device = self.engine.device
        if device == "auto":
            import torch

            return torch.cuda.is_available()
        return device.startswith("cuda")

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
