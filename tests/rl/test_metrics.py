"""Per-step metrics and alerts: n/a is None (never a made-up 0), alert_min_calls, the running mean."""

from __future__ import annotations

import json

import pytest

from tirl.agent.trajectory import ToolCallRecord, Trajectory
from tirl.rl.config import LoggingConfig
from tirl.rl.metrics import AlertMonitor, MetricsLogger, read_metrics, reward_metrics, rollout_metrics


def _traj(reward: float, statuses: list[str], finish: str = "answered") -> Trajectory:
    t = Trajectory(
        "p", [1], response_ids=[2, 3], loss_mask=[1, 1], turns=1, answer_blocks=1, finish_reason=finish
    )
    t.reward = reward
    t.tool_calls = [ToolCallRecord(turn=0, status=s, tool="python") for s in statuses]
    return t


def test_ratios_over_nothing_are_none_not_zero():
    groups = [[_traj(0.0, ["ok", "runtime_error"]), _traj(0.0, [], finish="no_answer")]]
    m = rollout_metrics(groups, [[0, 1]], no_tool_p_err=0.5)
    assert m["tools/error_ratio"] == 0.5
    assert m["tools/error_ratio_in_correct"] is None  # no correct trajectory: n/a
    assert m["roc/p_err_kept_pos"] is None and m["roc/p_err_dropped_pos"] is None
    assert m["finish/no_answer"] == 0.5 and m["finish/answered"] == 0.5
    groups = [[_traj(1.0, ["ok", "ok"]), _traj(1.0, [])]]
    m = rollout_metrics(groups, [[0, 1]], no_tool_p_err=0.5)
    assert m["tools/error_ratio_in_correct"] == 0.0  # correct trajectories whose calls all worked: a real 0
    m = rollout_metrics([[_traj(1.0, [])]], [[0]], no_tool_p_err=0.5)
    assert m["tools/error_ratio"] is None and m["tools/sandbox_failure_ratio"] is None


def test_none_is_null_in_jsonl_and_absent_from_tensorboard(tmp_path):
    logger = MetricsLogger(tmp_path, LoggingConfig(tensorboard=True))
    logger.log(1, {"tools/error_ratio_in_correct": None, "reward/mean": 0.5})
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {
        "step": 1,
        "tools/error_ratio_in_correct": None,
        "reward/mean": 0.5,
    }
    assert read_metrics(tmp_path)[0]["tools/error_ratio_in_correct"] is None
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert events.Tags()["scalars"] == ["reward/mean"]


def test_alerts_wait_for_enough_calls_and_a_running_mean():
    cfg = LoggingConfig(alert_min_calls=20, alert_tool_error_rate=0.5, alert_spike_factor=2.0)
    monitor = AlertMonitor(cfg)
    assert monitor.check({"tools/calls": 16, "tools/error_ratio": 0.9}) == []  # 16 < 20 calls: noise
    assert monitor.history == []  # and it does not enter the running mean
    assert monitor.check({"tools/calls": 40, "tools/error_ratio": 0.9}) == [
        "tool error ratio 90.0%"
    ]  # no mean yet
    for _ in range(2):
        assert monitor.check({"tools/calls": 40, "tools/error_ratio": 0.1}) == []
    # mean of the last steps (0.9, 0.1, 0.1) = 36.7%: 0.4 is not a spike (< 2x), 0.8 is
    assert monitor.check({"tools/calls": 40, "tools/error_ratio": 0.4}) == []
    assert monitor.check({"tools/calls": 40, "tools/error_ratio": 0.8}) == [
        "tool error ratio 80.0% (running mean 37.5%)"
    ]
    assert monitor.check({"tools/calls": 40, "tools/error_ratio": None}) == []


def test_reward_pool_stats_per_step():
    before = {
        "responses": 4,
        "no_answer": 0,
        "fast": 1,
        "verified": 3,
        "timeouts": 0,
        "killed": 0,
        "errors": 0,
        "verify_s": 0.3,
    }
    after = {**before, "responses": 10, "verified": 5, "timeouts": 1, "verify_s": 1.3}
    m = reward_metrics(before, after)
    assert (m["reward_pool/responses"], m["reward_pool/verified"], m["reward_pool/timeouts"]) == (6, 2, 1)
    assert m["reward_pool/verify_s_mean"] == pytest.approx(0.5)
    assert reward_metrics(before, before)["reward_pool/verify_s_mean"] is None


def test_forged_observations_are_counted_per_step_and_alert_past_their_share():
    """A model that writes its own <tool_response> frames: counted per step (turns, and the share of
    trajectories), alerted on every step past alert_forged_observation_share, however few its calls."""
    honest, forger = _traj(1.0, ["ok"]), _traj(1.0, [])
    forger.forged_observations = 2
    m = rollout_metrics([[honest, forger, _traj(0.0, [])]], [[0, 1]], no_tool_p_err=0.5)
    assert (m["tools/forged_observations"], m["tools/forged_traj_ratio"]) == (2, pytest.approx(1 / 3))
    monitor = AlertMonitor(LoggingConfig(alert_forged_observation_share=0.05))
    [alert] = [a for a in monitor.check(m) if "tool_response" in a]
    assert alert.startswith("33.3% of trajectories wrote a <tool_response> frame themselves (limit 5.0%)")
    assert monitor.should_stop(1, monitor.check(m)) is False  # warn by default
    quiet = rollout_metrics([[honest, _traj(0.0, [])]], [[0, 1]], no_tool_p_err=0.5)
    assert quiet["tools/forged_traj_ratio"] == 0.0 and monitor.check(quiet) == []
    off = AlertMonitor(LoggingConfig(alert_forged_observation_share=None))
    assert not [a for a in off.check(m) if "tool_response" in a]
