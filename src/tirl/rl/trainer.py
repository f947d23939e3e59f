"""The GRPO-RoC trainer (`tirl train`): multi-stage agentic RL with checkpoint/resume and FSDP2.

The RL step is `rl_step`, top to bottom. Rollouts, rewards and RoC run on rank 0 through its
runtime (tirl.runtime: engines, sandbox, reward workers; `cluster.backend` local or ray); the kept
samples go to the learner (tirl.rl.learner: this process and the other torchrun ranks, or Ray trainer
workers), where every rank trains on its share; then the weights are synced into the engines. Everything random is derived from (seed, step, ...), so a resumed
run replays exactly the batches an uninterrupted run would have drawn.

The objective is assembled from named parts (tirl.rl.advantages, tirl.rl.losses: policy loss,
aggregation, dual clip, KL, entropy) by `grpo_update`; the defaults are the paper's. Departures:
- a trajectory an infrastructure failure ended (engine or sandbox) gets reward 0, is never a RoC
  candidate nor trained on, but counts in the metrics (so the sandbox alert can fire);
- truncated (over-length) trajectories keep reward 0, as in the paper (overlong filtering hurt);
- RoC reads 1/p_total in the limit (perfect positives first; tirl.rl.roc), where the paper is silent.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from tirl.agent.protocol import check_context
from tirl.config import ConfigError, redacted_dump
from tirl.distributed.groups import (
    DistInfo,
    broadcast_object,
    init_distributed,
    shutdown_distributed,
)
from tirl.engines.versions import EngineActivity, WeightVersions
from tirl.rl import trajectory_sample
from tirl.rl.advantages import resolve_advantage
from tirl.rl.async_rollout import GroupProducer, StepGroups
from tirl.rl.checkpoint import (
    checkpoint_model_dir,
    load_trainer_state,
    prepare_run_dir,
    resolve_model_path,
)
from tirl.rl.config import AlgorithmConfig, StageConfig, TrainConfig, uncorrected_async_message
from tirl.rl.learner import Learner, open_learner
from tirl.rl.lora import check_lora
from tirl.rl.metrics import (
    AlertMonitor,
    MetricsLogger,
    Timer,
    TrainingStopped,
    reward_metrics,
    rollout_metrics,
    stop_message,
)
from tirl.rl.policy import TrainSample
from tirl.rl.roc import resample_on_correct
from tirl.rl.sampler import EpochSampler
from tirl.runtime import Runtime, open_cluster_placement, open_runtime
from tirl.runtime.handoff import Handoff, handoff_for, open_handoff
from tirl.seeds import derive_seed

if TYPE_CHECKING:
    from tirl.runtime.ray_cluster import Placement

T = TypeVar("T")

FAULT_ENV = "TIRL_FAULT"


def fault_point(phase: str, step: int) -> None:
    """Fault injection for the resume tests: TIRL_FAULT="PHASE:STEP" SIGKILLs this process when
    step STEP (1-based) reaches PHASE: "rollout" (its first trajectory is done, the rest in flight),
    "update" (weights, optimizer and LR schedule updated; not yet synced, logged or checkpointed),
    or "logged" (its metrics written, its checkpoint not)."""
    if os.environ.get(FAULT_ENV) == f"{phase}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


@asynccontextmanager
async def open_main_runtime(
    cfg: TrainConfig,
    model_path: str,
    info: DistInfo,
    placement: Placement | None,
    opened: Runtime | None = None,
) -> AsyncIterator[Runtime | None]:
    """The runtime (cfg.cluster: engines serving `model_path`, sandbox, reward workers), on rank 0 only;
    `opened`: the caller's, serving `model_path` already (left open)."""
    if not info.is_main:
        yield None
        return
    if opened is not None:
        opened.engine_metrics()  # the rollout window starts with this run, not with the caller's work
        yield opened
        return
    engine_cfg = cfg.engine.model_copy(update={"model": model_path})
    async with open_runtime(cfg.cluster, engine_cfg, cfg.sandbox, cfg.reward, placement=placement) as runtime:
        yield runtime


def roc_select(group: list, alg: AlgorithmConfig, seed: int) -> list[int]:
    """RoC's kept indices into `group`. A trajectory an infrastructure error ended says nothing about
    the policy: it is never a candidate (but still counted by the metrics)."""
    candidates = [i for i, t in enumerate(group) if not t.failed]
    chosen = resample_on_correct(
        [group[i] for i in candidates],
        alg.group_size,
        np.random.default_rng(seed),
        mode=alg.roc,
        min_per_class=alg.roc_min_per_class,
        drop_uniform=alg.drop_uniform_groups,
        no_tool_p_err=alg.no_tool_p_err,
    )
    return [candidates[j] for j in chosen]


def build_samples(groups, kept: list[list[int]], advantage: str = "grpo") -> list[TrainSample]:
    """One sample per kept trajectory, with its group-relative advantage (the named estimator of
    tirl.rl.advantages) on every trained token."""
    estimate = resolve_advantage(advantage)
    samples = []
    for group, idx in zip(groups, kept, strict=True):
        members = [group[i] for i in idx]
        for t, adv in zip(members, estimate([t.reward for t in members]), strict=True):
            if sum(t.loss_mask) == 0:  # nothing generated (e.g. an engine error): nothing to train
                continue
            mask = [0] * (len(t.prompt_ids) - 1) + list(t.loss_mask)
            engine_logprobs = [0.0] * (len(t.prompt_ids) - 1) + list(t.logprobs)
            samples.append(
                TrainSample(
                    list(t.prompt_ids) + list(t.response_ids), mask, adv, engine_logprobs=engine_logprobs
                )
            )
    return samples


@dataclass
class TrainerState:
    step: int = 0  # RL steps done (global, over stages)
    stage: int = 0
    stage_step: int = 0  # steps done in the current stage


@dataclass
class Run:
    cfg: TrainConfig
    info: DistInfo
    learner: Learner  # the policy here (and on the other torchrun ranks), or Ray trainer workers
    runtime: Runtime | None  # rank 0 only
    state: TrainerState
    logger: MetricsLogger | None
    alerts: AlertMonitor
    versions: WeightVersions | None = None  # the engines' policy version and sync gate (rank 0 only)
    reward_stats: dict = field(default_factory=dict)  # the reward pool's counters at the last step's end
    handoff: Handoff | None = None  # this rank's devices and weights between trainer and engines

    def __post_init__(self) -> None:
        if self.handoff is None:  # (a caller's runtime, opened already)
            async_ = self.cfg.algorithm.async_
            self.handoff = handoff_for(self.runtime, self.learner, self.info, self.cfg.cluster, async_)

    async def blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking learner call; in async mode off the event loop, so rollouts go on meanwhile."""
        if self.cfg.algorithm.async_:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)


def stage_agent_config(cfg: TrainConfig, stage: StageConfig):
    update = {"max_turns": stage.max_turns, "max_response_tokens": stage.max_response_tokens}
    return cfg.agent.model_copy(update={k: v for k, v in update.items() if v is not None})


def load_stage_problems(stage: StageConfig) -> list:
    from tirl.data import DataError, load_problems

    try:
        problems = load_problems(stage.data, limit=stage.data_limit)
    except DataError as e:
        raise ConfigError(
            f"stage {stage.name!r}: cannot load its data: {e}. If it is the hard-problem set, make it with "
            "`tirl data filter-hard --checkpoint RUN/checkpoints/step_N --data ... -k 8 --out FILE`, "
            "then continue this run with --resume"
        ) from e
    if not problems:
        raise ConfigError(f"stage {stage.name!r}: no problems in {stage.data!r}")
    return problems


async def rl_step(run: Run, producer: GroupProducer | None, save: bool = False) -> dict:
    """One GRPO-RoC step: prompts -> rollouts -> rewards -> RoC -> advantages -> update -> sync -> metrics.

    Steps 1-4 stream inside `producer` (tirl.rl.async_rollout): prompts are drawn and rolled out as
    there is room, each trajectory is scored as it ends and each group goes through RoC as its last
    member ends; with `algorithm.async` it keeps generating the next steps' groups during 6 and 7.
    Colocated, the engines lend their devices to the trainer for 6 and get them back around 7; the
    weights reach them in 7 (`run.handoff`, tirl.runtime.handoff: the one safe order, with its barriers,
    and the way to the engines the runtime chose). `save`: the step's
    checkpoint is written right after its update, where the trainer's state is on its devices and
    colocated engines are asleep anyway; it becomes visible after the step's metrics (`checkpoint`).
    """
    alg, step, handoff = run.cfg.algorithm, run.state.step, run.handoff
    timer = Timer()
    start, engines_before = time.perf_counter(), run.versions.snapshot() if run.versions else None
    metrics: dict = {"stage": run.state.stage}
    samples: list[TrainSample] | None = None
    if run.info.is_main:
        # 1-4. the step's P complete groups: sampled prompts (deterministic in (seed, stage, epoch,
        # position)), 2G rollouts each on the engine pool with tool calls in the sandbox as each turn
        # ends, binary answer-only rewards (math-verify in worker processes) as each trajectory ends,
        # and Resample-on-Correct's G of 2G as each group completes (of the trajectories no
        # infrastructure error ended). Groups more than k versions stale are dropped and re-queued.
        with timer("rollout"):  # the trainer waits for the groups (its idle time)
            batch = await producer.take(step)
        # 5. group-relative advantages on the kept members
        samples = build_samples(batch.groups, batch.kept, alg.advantage)
        metrics |= _rollout_report(run, batch)
    # 6. update: every rank trains on its share of the kept samples
    samples = broadcast_object(samples, run.info)
    metrics |= handoff.to_trainer()
    with timer("train"):
        metrics |= await run.blocking(run.learner.update, samples, alg)
    fault_point("update", step + 1)
    if save:  # 6b. the checkpoint's device half: every rank's shards and the export, staged
        with timer("checkpoint"):
            await run.blocking(run.learner.stage_checkpoint, run.cfg.run_dir, step + 1)
    handoff.to_sync()
    metrics["perf/train_tokens_per_s"] = metrics["train/trained_tokens"] / max(timer.seconds["train"], 1e-9)
    # 7. weight sync: the engines sample from the updated policy from the next turn on
    # (turns in flight go on under the new weights: partial rollouts; tirl.engines.versions)
    with timer("sync"):
        metrics |= await handoff.sync(run.versions, step + 1, off_loop=alg.async_)
    if producer is not None:
        producer.synced(step + 1)
    handoff.to_engines()
    metrics |= _overlap_metrics(run, timer, time.perf_counter() - start, engines_before)
    return metrics | timer.metrics()


def _rollout_report(run: Run, batch: StepGroups) -> dict:
    """The rollout half's metrics (engines, rewards, RoC on ALL trajectories), and a bounded sample of
    trajectories with RoC's view of them for `tirl view`."""
    cfg, alg, rt = run.cfg, run.cfg.algorithm, run.runtime
    metrics = {"batch": [p.id for p in batch.problems]}
    metrics |= rt.engine_metrics()  # the scheduler's per-engine window of this step
    reward_now = rt.scorer.stats.as_dict()
    metrics |= reward_metrics(run.reward_stats, reward_now) | batch.metrics
    run.reward_stats = reward_now
    metrics |= rollout_metrics(batch.groups, batch.kept, alg.no_tool_p_err)
    if cfg.logging.trajectories_per_step:
        sample = trajectory_sample.step_sample(
            run.state.step + 1,
            run.state.stage,
            batch.problems,
            batch.groups,
            batch.kept,
            cfg.logging.trajectories_per_step,
            cfg.seed,
            alg.advantage,
            alg.no_tool_p_err,
        )
        trajectory_sample.append(cfg.run_dir, sample)
    return metrics


def _overlap_metrics(run: Run, timer: Timer, wall_s: float, before: EngineActivity | None) -> dict:
    """Shares of the step's wall time the trainer waited for groups and no engine generated a turn, and
    the engines' tokens per second while generating (a rollout may span steps in async mode)."""
    if run.versions is None or before is None:
        return {}
    now = run.versions.snapshot()
    busy, tokens = now.busy_s - before.busy_s, now.tokens - before.tokens
    wall = max(wall_s, 1e-9)
    return {
        "perf/rollout_tokens_per_s": tokens / max(busy, 1e-9),
        "perf/trainer_idle_frac": timer.seconds["rollout"] / wall,
        "perf/engine_idle_frac": max(0.0, 1.0 - busy / wall),
    }


def checkpoint(run: Run, sampler: EpochSampler, producer: GroupProducer | None) -> None:
    """The checkpoint `rl_step(save=True)` staged (weights, optimizer) made visible with the schedule,
    RNG, counters, and where the prompt stream stands: the sampler and the draws admitted but not
    trained on yet (their trajectories are regenerated on resume). Host memory only: no device moves."""
    st = run.state
    trainer_state = {
        "step": st.step,
        "stage": st.stage,
        "stage_step": st.stage_step,
        "sampler": sampler.state_dict(),
        "producer": producer.state_dict() if producer is not None else None,
    }
    tokenizer = run.runtime.tokenizer if run.runtime else None
    run.learner.publish_checkpoint(
        run.cfg.run_dir, st.step, tokenizer, trainer_state, run.cfg.checkpoint.keep_last
    )


def discard_staged(run_dir: Path) -> None:
    """Checkpoints a killed or stopped run staged (rl_step writes one right after its update) and never
    made visible (after the step's metrics): the resumed run redoes that step."""
    for staged in (Path(run_dir) / "checkpoints").glob(".tmp_step_*"):
        shutil.rmtree(staged, ignore_errors=True)


def run_training(cfg: TrainConfig, resume: bool = False, progress: bool = True) -> Path:
    """Train with GRPO-RoC through all stages; returns the run directory (checkpoints, metrics)."""
    info = init_distributed(cfg.optim.device)
    clean = False
    try:
        run_dir = asyncio.run(_train(cfg, info, resume, progress))
        clean = True
        return run_dir
    finally:
        shutdown_distributed(synchronize=clean)


async def train_on(runtime: Runtime, cfg: TrainConfig, progress: bool = True) -> Path:
    """run_training from the start on a runtime the caller opened (and closes) with cfg.cluster,
    cfg.sandbox and cfg.reward, its engines serving cfg.model: in one process, and the engines end on
    the last step's weights. What a caller that evaluates before and after saves: two engine starts
    (tirl demo)."""
    info = init_distributed(cfg.optim.device)
    if info.enabled:
        raise ConfigError("train_on runs in one process: launch torchrun runs with run_training")
    return await _train(cfg, info, resume=False, progress=progress, runtime=runtime)


def model_paths(cfg: TrainConfig, ckpt: Path | None, info: DistInfo) -> tuple[str, str]:
    """The trainer's model and the engines' (`resolve_model_paths`), resolved by rank 0 alone: a LoRA
    adapter is merged there (fp32 on the host: 59 GB at 14B) while the other ranks wait at its gate
    (the rendezvous store, not a collective with its short timeout) and then take its answer."""
    paths = resolve_model_paths(cfg, ckpt) if info.is_main else None
    policy, engines = broadcast_object(paths, info)
    return policy, engines


def resolve_model_paths(cfg: TrainConfig, ckpt: Path | None) -> tuple[str, str]:
    """The trainer's model and the engines' (resumed: the checkpoint's). With LoRA the trainer always
    starts from the frozen base (a resumed run's adapter comes from its shards) and only the engines
    serve the checkpoint's merged model."""
    base = resolve_model_path(cfg.model)
    if ckpt is None:
        return base, base
    if cfg.optim.lora.enabled:
        return base, str(checkpoint_model_dir(ckpt))
    resumed = str(checkpoint_model_dir(ckpt))
    return resumed, resumed


async def _train(
    cfg: TrainConfig, info: DistInfo, resume: bool, progress: bool, runtime: Runtime | None = None
) -> Path:
    from rich.console import Console

    console = Console(stderr=True, quiet=not (progress and info.is_main))
    ckpt = prepare_run_dir(cfg.run_dir, cfg, resume, info.is_main, console.print)
    if info.is_main:
        discard_staged(cfg.run_dir)
    saved = load_trainer_state(ckpt) if ckpt else None
    state = (
        TrainerState(**{k: saved[k] for k in ("step", "stage", "stage_step")}) if saved else TrainerState()
    )
    if state.stage >= len(cfg.stages):
        console.print(f"{cfg.run_dir}: all {len(cfg.stages)} stages are done")
        return cfg.run_dir
    policy_path, model_path = model_paths(cfg, ckpt, info)
    check_lora(policy_path, cfg.optim.lora)
    if cfg.algorithm.kl_coef and (info.enabled or cfg.cluster.trainer.ranks > 1):
        raise ConfigError(
            "algorithm.kl_coef > 0 (a reference model) is supported in single-process runs only"
        )
    logger = MetricsLogger(cfg.run_dir, cfg.logging, redacted_dump(cfg)) if info.is_main else None
    if logger and saved:
        logger.truncate_after(state.step)
        trajectory_sample.truncate_after(cfg.run_dir, state.step)
    try:
        with open_cluster_placement(cfg.cluster, cfg.engine.num_engines) as placement:
            async with open_learner(
                cfg, policy_path, info, cfg.stages[state.stage].steps, placement
            ) as learner:
                engines = lambda: open_main_runtime(cfg, model_path, info, placement, runtime)  # noqa: E731
                async with open_handoff(learner, info, cfg.cluster, cfg.algorithm.async_, engines) as handoff:
                    alerts = _alert_monitor(cfg)
                    run = Run(cfg, info, learner, handoff.engines, state, logger, alerts, handoff=handoff)
                    await _run_stages(run, saved, console)
    finally:
        if logger:
            logger.close()
    return cfg.run_dir


async def _run_stages(run: Run, saved: dict | None, console) -> None:
    cfg, state, runtime = run.cfg, run.state, run.runtime
    _announce_correction(cfg, console)
    if runtime is not None:
        run.versions = WeightVersions(state.step)
        run.reward_stats = runtime.scorer.stats.as_dict()
    for stage_index in range(state.stage, len(cfg.stages)):
        await _run_stage(run, stage_index, saved if stage_index == state.stage else None, console)
        saved = None


def snapshot_reference(run: Run) -> None:
    """The KL reference copied from the policy where it trains: colocated, the trainer's state is on the
    host between steps, and a copy made there would stay there while the update's inputs are on the GPU."""
    with run.handoff.trainer_resident():
        run.learner.snapshot_reference()


async def _run_stage(run: Run, stage_index: int, saved: dict | None, console) -> None:
    cfg, st, learner = run.cfg, run.state, run.learner
    stage = cfg.stages[stage_index]
    problems = load_stage_problems(stage) if run.info.is_main else []
    if problems and run.runtime is not None:
        agent = stage_agent_config(cfg, stage)
        check_context(
            run.runtime.tokenizer, problems, agent, cfg.engine.max_model_len, f"stage {stage.name!r}"
        )
    n = int(broadcast_object(len(problems), run.info))
    sampler = EpochSampler(n, derive_seed(cfg.seed, stage_index))
    learner.reset_optimizer(stage.steps)  # a fresh optimizer and warm-up at every stage boundary
    if cfg.algorithm.kl_coef:  # (a run resumed mid-stage takes its reference from the resume point)
        snapshot_reference(run)
    if saved is not None:  # resuming inside this stage: restore exactly where it stopped
        sampler.load_state_dict(saved["sampler"])
        with run.handoff.trainer_resident():  # read into the shards where FSDP2 placed them
            learner.restore(saved)
    else:
        st.stage, st.stage_step = stage_index, 0
    console.print(
        f"[bold]stage {stage.name}[/] ({stage_index + 1}/{len(cfg.stages)}): {stage.steps} steps, {n} problems"
    )
    producer = _open_producer(run, stage, problems, sampler, saved) if problems else None
    try:
        while st.stage_step < stage.steps:
            start = time.perf_counter()
            due = (st.step + 1) % cfg.checkpoint.every == 0 or st.stage_step + 1 == stage.steps
            metrics = await rl_step(run, producer, save=due)
            st.step, st.stage_step = st.step + 1, st.stage_step + 1
            metrics["time/step_s"] = time.perf_counter() - start
            stop = None
            if run.info.is_main:
                stop = _report(run, stage, metrics, console)
                fault_point("logged", st.step)
            if broadcast_object(stop, run.info):  # every rank stops, before this step's checkpoint
                raise TrainingStopped(stop)
            # Metrics first, then the checkpoint: a kill in between only makes the resumed run redo
            # (and re-log) this step; the reverse order could lose its metrics line.
            if due:
                checkpoint(run, sampler, producer)
    finally:
        if producer is not None:
            await producer.close()
    st.stage = stage_index + 1
    st.stage_step = 0


def _open_producer(
    run: Run, stage: StageConfig, problems: list, sampler: EpochSampler, saved: dict | None
) -> GroupProducer:
    """The stage's group stream (rank 0), resumed from a checkpoint's pending draws if there is one."""
    cfg, alg, st = run.cfg, run.cfg.algorithm, run.state
    return GroupProducer(
        run.runtime,
        run.versions,
        problems,
        sampler,
        stage_agent_config(cfg, stage),
        lambda group, seed: roc_select(group, alg, seed),
        prompts_per_step=alg.prompts_per_step,
        rollouts_per_prompt=alg.rollouts_per_prompt,
        max_staleness=alg.staleness_bound,
        seed=cfg.seed,
        first_step=st.step - st.stage_step,
        steps=stage.steps,
        steps_done=st.stage_step,
        concurrency=cfg.rollout_concurrency,
        exact=alg.exact_staleness,
        on_trajectory=lambda _: fault_point("rollout", st.step + 1),
        state=saved.get("producer") if saved else None,
    )


def _alert_monitor(cfg: TrainConfig) -> AlertMonitor:
    # The engine reports log-probs of its sampling distribution: comparable to the trainer's at T = 1 only.
    comparable = cfg.agent.temperature == 1.0 and cfg.agent.top_p == 1.0
    return AlertMonitor(cfg.logging, comparable_logprobs=comparable)


def _announce_correction(cfg: TrainConfig, console) -> None:
    """Say which off-policy correction an asynchronous run trains with (the default, or none)."""
    alg = cfg.algorithm
    if not alg.async_ or alg.max_staleness == 0:
        return
    if alg.tis_cap is None:
        console.print(f"[bold red]WARNING:[/] {uncorrected_async_message(alg.max_staleness)}")
    else:
        how = "the async default; algorithm.tis_cap=null turns it off" if alg.tis_defaulted else "set by you"
        console.print(
            f"async, max_staleness={alg.max_staleness} ({alg.staleness_mode}): off-policy correction "
            f"TIS with cap {alg.tis_cap} ({how})"
        )


def _report(run: Run, stage: StageConfig, metrics: dict, console) -> str | None:
    """Log the step with its alerts; the stop message when `logging.alert_action=stop` says to stop."""
    st = run.state
    alerts = run.alerts.check(metrics)
    for alert in alerts:
        console.print(f"[bold red]ALERT step {st.step}:[/] {alert}")
        metrics.setdefault("alerts", []).append(alert)
    run.logger.log(st.step, metrics)
    console.print(
        f"step {st.step} ({stage.name} {st.stage_step}/{stage.steps}) reward {_fmt(metrics['reward/mean'], '.3f')} "
        f"len {_fmt(metrics['response/length_mean'], '.0f')} tools {_fmt(metrics['tools/calls_per_traj'], '.2f')} "
        f"err {_fmt(metrics['tools/error_ratio'], '.1%')} loss {metrics['train/loss']:+.4f} {metrics['time/step_s']:.1f}s",
        markup=False,
    )
    if not run.alerts.should_stop(st.step, alerts):
        return None
    from rich.markup import escape

    message = stop_message(run.cfg.run_dir, st.step, run.alerts.streak_start, alerts)
    console.print(f"[bold red]STOP:[/] {escape(message)}")  # a path may hold [brackets]
    return message


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)
