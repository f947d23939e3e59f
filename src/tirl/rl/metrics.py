"""Per-step training metrics: what the rollouts did, what RoC kept, where the time went, what the
reward pool did (the scheduler's per-engine window: tirl.runtime.Runtime.engine_metrics); and the
alerts on them.

Written as JSONL (one line per step), TensorBoard scalars, and W&B when enabled and installed. A value
that does not exist this step (a ratio over nothing) is None: null in the JSONL, absent from
TensorBoard / W&B.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from tirl.agent.trajectory import tool_error_ratio
from tirl.rl.config import LoggingConfig
from tirl.rl.roc import is_positive, penalties


def _mean(xs) -> float | None:
    """Mean, or None (n/a) when there is nothing to average."""
    xs = list(xs)
    return float(np.mean(xs)) if xs else None


def rollout_metrics(groups: Sequence[Sequence], kept: Sequence[Sequence[int]], no_tool_p_err: float) -> dict:
    """Statistics of ALL rollouts of a step (those an infrastructure error ended included, so the
    sandbox alert can see them), and of what RoC kept vs dropped among the scored ones.

    A ratio with nothing to count is None (n/a): logged as null in metrics.jsonl, left out of
    TensorBoard / W&B, never a made-up 0.
    """
    every = [t for g in groups for t in g]
    kept_t = [g[i] for g, k in zip(groups, kept, strict=True) for i in k]
    dropped = [
        t
        for g, k in zip(groups, kept, strict=True)
        for i, t in enumerate(g)
        if i not in set(k) and not t.failed
    ]
    correct = [t for t in every if is_positive(t)]
    calls = [c for t in every for c in t.tool_calls]
    wait = sum(t.tool_wait_seconds for t in every)
    busy = wait + sum(t.gen_seconds for t in every)
    m = {
        "reward/mean": _mean(t.reward for t in every),
        "reward/kept_mean": _mean(t.reward for t in kept_t),
        "reward/solve_all_ratio": _mean(all(is_positive(t) for t in g) for g in groups),
        "reward/solve_none_ratio": _mean(not any(is_positive(t) for t in g) for g in groups),
        "response/length_mean": _mean(t.response_length for t in every),
        "response/length_max": max((t.response_length for t in every), default=0),
        "response/turns_mean": _mean(t.turns for t in every),
        "rollout/errors": sum(t.failed for t in every),
        "tools/calls": len(calls),
        "tools/calls_per_traj": _mean(t.num_tool_calls for t in every),
        "tools/error_ratio": tool_error_ratio(every),
        # The paper's Figure 4 quantity: errored calls among the calls of CORRECT trajectories.
        "tools/error_ratio_in_correct": tool_error_ratio(correct),
        "tools/sandbox_failure_ratio": sum(c.infra_failed for c in calls) / len(calls) if calls else None,
        "tools/wait_s_mean": _mean(t.tool_wait_seconds for t in every),
        # Turns in which the model wrote a <tool_response> frame itself (a made-up observation), and the
        # share of trajectories with one (tirl.agent.protocol.forged_frame_at).
        "tools/forged_observations": sum(t.forged_observations for t in every),
        "tools/forged_traj_ratio": _mean(t.forged_observations > 0 for t in every),
        # Share of trajectory time spent waiting for tool results (async: other trajectories go on).
        "time/tool_wait_share": wait / busy if busy > 0 else None,
        "roc/groups": len(groups),
        "roc/groups_kept": sum(bool(k) for k in kept),
        "roc/groups_dropped": sum(not k for k in kept),
        "roc/kept": len(kept_t),
        "roc/dropped": len(dropped),
    }
    for name in sorted({c.tool for c in calls if c.tool}):
        mine = [c for c in calls if c.tool == name]
        m[f"tools/{name}/calls"] = len(mine)
        m[f"tools/{name}/error_ratio"] = sum(c.errored for c in mine) / len(mine)
    for name, trajs in (("kept", kept_t), ("dropped", dropped)):
        pos = [penalties(t, no_tool_p_err) for t in trajs if is_positive(t)]
        m[f"roc/p_err_{name}_pos"] = _mean(p.p_err for p in pos)
        m[f"roc/p_format_{name}_pos"] = _mean(p.p_format for p in pos)
    for reason, n in Counter(t.finish_reason for t in every).items():
        m[f"finish/{reason}"] = n / len(every)
    return m


def reward_metrics(before: dict, after: dict) -> dict:
    """What the reward pool did during one step: counts and verification latency (RewardStats deltas)."""
    d = {k: after[k] - before.get(k, 0) for k in after}
    return {
        "reward_pool/responses": d["responses"],
        "reward_pool/verified": d["verified"],
        "reward_pool/timeouts": d["timeouts"],
        "reward_pool/errors": d["errors"],
        "reward_pool/killed": d["killed"],
        "reward_pool/verify_s_mean": d["verify_s"] / d["verified"] if d["verified"] else None,
    }


class Timer:
    """Wall time per named phase of a step (`with timer("rollout"): ...`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"time/{k}_s": v for k, v in self.seconds.items()}


class TrainingStopped(RuntimeError):
    """logging.alert_action=stop ended the run (the message names the checkpoint to go back to)."""


class AlertMonitor:
    """Flags a step whose tool error ratio or sandbox failure ratio spikes, or whose off-policy signals
    (engine log-prob gap, length-limit share, TIS truncation, ratio max, approx KL) pass their limits;
    and counts consecutive alerting steps for `alert_action=stop`.

    Forged observations (`alert_forged_observation_share`: the share of trajectories in which the model
    wrote a tool-response frame itself) are watched on every step.

    Tool use itself is watched on every step (`alert_tool_use_drop`, `alert_tool_use_floor`): a model that
    stops calling its tool makes few calls, which the error alerts skip. A step with fewer than
    `alert_min_calls` tool calls raises no tool-error alert and does not enter the
    running mean (the ratio of a few calls is noise); the spike test needs a running mean of at least
    `_MIN_HISTORY` such steps. The engine log-prob gap is only watched when `comparable_logprobs` (the
    agent samples at temperature 1 and top_p 1): otherwise the engine's log-probs are of another
    distribution and the gap is large by construction.
    """

    _MIN_HISTORY = 3
    _EARLY_STEPS = 3  # the steps whose calls per trajectory are the early-run level of tool use

    def __init__(self, cfg: LoggingConfig, comparable_logprobs: bool = True):
        self.cfg = cfg
        self.comparable_logprobs = comparable_logprobs
        self.history: list[float] = []
        self.early_tool_use: list[float] = []  # calls per trajectory of the first _EARLY_STEPS steps
        self.streak_start: int | None = None  # first step of the current run of alerting steps
        self.streak = 0

    def check(self, m: dict) -> list[str]:
        return (
            self._tool_use_alerts(m)
            + self._forged_alerts(m)
            + self._tool_alerts(m)
            + self._off_policy_alerts(m)
        )

    def _forged_alerts(self, m: dict) -> list[str]:
        """A policy that learns to write its own tool responses: watched on every step, however few calls
        (a forging model may call its tool less)."""
        share, limit = m.get("tools/forged_traj_ratio"), self.cfg.alert_forged_observation_share
        if share is None or limit is None or share <= limit:
            return []
        return [
            f"{share:.1%} of trajectories wrote a <tool_response> frame themselves (limit {limit:.1%}): the "
            "model is making up tool output; agent.stop_at_forged_observation=true keeps it from being run "
            "or trained on"
        ]

    def _tool_use_alerts(self, m: dict) -> list[str]:
        per = m.get("tools/calls_per_traj")
        if per is None:
            return []
        floor, drop = self.cfg.alert_tool_use_floor, self.cfg.alert_tool_use_drop
        if len(self.early_tool_use) < self._EARLY_STEPS:
            self.early_tool_use.append(per)
            early = None
        else:
            early = float(np.mean(self.early_tool_use))
        if floor is not None and per < floor:
            return [
                f"tool calls per trajectory {per:.2f} below the floor {floor:g}: the model stopped using its tool"
            ]
        if drop is not None and early and per < drop * early:
            return [
                f"tool calls per trajectory fell to {per:.2f} from {early:.2f} in the first {self._EARLY_STEPS} "
                f"steps (alert below {drop:.0%} of it): the model is giving up its tool, whatever the reward says"
            ]
        return []

    def _tool_alerts(self, m: dict) -> list[str]:
        if m.get("tools/calls", 0) < self.cfg.alert_min_calls:
            return []
        alerts = []
        err = m.get("tools/error_ratio")
        if err is not None:
            recent = self.history[-20:]
            mean = float(np.mean(recent)) if len(recent) >= self._MIN_HISTORY else None
            spike = mean is not None and mean > 0 and err > self.cfg.alert_spike_factor * mean
            if err > self.cfg.alert_tool_error_rate or spike:
                since = f" (running mean {mean:.1%})" if mean is not None else ""
                alerts.append(f"tool error ratio {err:.1%}{since}")
            self.history.append(err)
        infra = m.get("tools/sandbox_failure_ratio")
        if infra is not None and infra > self.cfg.alert_sandbox_failure_rate:
            alerts.append(
                f"sandbox failure ratio {infra:.1%}: check the sandbox service (tirl sandbox serve)"
            )
        return alerts

    def _off_policy_alerts(self, m: dict) -> list[str]:
        """What moved when asynchronous training without correction collapsed (docs/results-async.md)."""
        cfg, alerts = self.cfg, []

        def over(key: str, limit: float | None) -> float | None:
            value = m.get(key)
            return value if limit is not None and value is not None and value > limit else None

        if self.comparable_logprobs and (
            gap := over("train/engine_logprob_gap", cfg.alert_engine_logprob_gap)
        ):
            alerts.append(
                f"engine-trainer log-prob gap {gap:.3f} nats/token (limit {cfg.alert_engine_logprob_gap}): "
                "the engines sampled from a policy far from the trainer's (stale weights, a failed sync, or a "
                "policy moving fast)"
            )
        if (share := over("finish/length", cfg.alert_length_limit_share)) is not None:
            alerts.append(
                f"{share:.0%} of rollouts hit the length limit (limit {cfg.alert_length_limit_share:.0%})"
            )
        if (frac := over("train/tis_truncated_frac", cfg.alert_tis_truncated_frac)) is not None:
            alerts.append(
                f"TIS truncated {frac:.1%} of tokens (limit {cfg.alert_tis_truncated_frac:.1%}): the engines' "
                "policy is far behind the trainer's"
            )
        if (ratio := over("train/ratio_max", cfg.alert_ratio_max)) is not None:
            alerts.append(f"importance ratio max {ratio:.1f} (limit {cfg.alert_ratio_max})")
        if (kl := over("train/approx_kl", cfg.alert_approx_kl)) is not None:
            alerts.append(f"approx KL {kl:.3f} per token in one update (limit {cfg.alert_approx_kl})")
        return alerts

    def should_stop(self, step: int, alerts: list[str]) -> bool:
        """Count consecutive alerting steps; True when `alert_action=stop` and there are enough of them."""
        if not alerts:
            self.streak_start, self.streak = None, 0
            return False
        if self.streak_start is None:
            self.streak_start = step
        self.streak += 1
        return self.cfg.alert_action == "stop" and self.streak >= self.cfg.alert_stop_after


def stop_message(run_dir: Path, step: int, first_alert_step: int, alerts: list[str]) -> str:
    """Why the run stopped, and the newest checkpoint written before the alerting steps began."""
    good = last_good_checkpoint(run_dir, first_alert_step)
    where = (
        f"The last good checkpoint is {good} (step {first_alert_step - 1} or earlier); start a new run "
        f"from its model/ (model={good / 'model'}) with a smaller lr or an off-policy correction"
        if good
        else "No checkpoint was written before the alerts began: restart from the initial model with a "
        "smaller lr or an off-policy correction"
    )
    steps = f"step {step}" if first_alert_step == step else f"steps {first_alert_step}-{step}"
    return (
        f"stopped by logging.alert_action=stop after alerts on {steps}: {'; '.join(alerts)}. {where}. "
        "Set logging.alert_action=warn to only warn."
    )


def last_good_checkpoint(run_dir: Path, first_alert_step: int) -> Path | None:
    """The newest checkpoint written before the alerting steps began (None: there is none)."""
    from tirl.rl.checkpoint import list_checkpoints

    good = [path for n, path in list_checkpoints(run_dir) if n < first_alert_step]
    return good[-1] if good else None


def final_alert_streak(run_dir: Path) -> tuple[int, int, list[str]] | None:
    """The alerting steps metrics.jsonl ends with (what `alert_action=stop` stopped on): the first and the
    last step, and the last step's alerts; None when the last logged step raised no alert."""
    steps: dict[int, list[str]] = {}
    for record in read_metrics(run_dir):  # a resumed run re-logs redone steps: the newest line counts
        steps[record["step"]] = record.get("alerts", [])
    last = max(steps, default=None)
    if last is None or not steps[last]:
        return None
    first = last
    while steps.get(first - 1):
        first -= 1
    return first, last, steps[last]


class MetricsLogger:
    """JSONL + TensorBoard (+ W&B) sink for the main rank."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, run_config: dict | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb = self._wandb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if cfg.wandb:
            try:
                import wandb
            except ImportError:
                print(
                    "logging.wandb is on but wandb is not installed: pip install wandb (continuing without)"
                )
            else:
                self._wandb = wandb.init(
                    project=cfg.wandb_project, name=Path(run_dir).name, config=run_config
                )

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps the checkpoint does not contain (they will be redone)."""
        if not self.path.exists():
            return
        lines = [ln for ln in self.path.read_text().splitlines() if ln.strip()]
        keep = [ln for ln in lines if json.loads(ln).get("step", 0) <= step]
        self.path.write_text("".join(ln + "\n" for ln in keep))

    def log(self, step: int, metrics: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        numeric = {k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
