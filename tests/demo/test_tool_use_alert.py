"""The guard rail on tool use, in every training run: the real AlertMonitor, fed the real per-step
metrics of trajectories, alerts when the model gives up its tool, even on steps with few calls (which
the tool-error alerts skip) and even while the reward rises."""

from __future__ import annotations

from tirl.agent.trajectory import ToolCallRecord, Trajectory
from tirl.rl.config import LoggingConfig
from tirl.rl.metrics import AlertMonitor, rollout_metrics


def _step(calls_per_traj: list[int], reward: float = 0.0) -> dict:
    """One step's metrics: a group of trajectories with these many (working) tool calls each."""
    group = []
    for n in calls_per_traj:
        t = Trajectory("p", [1], response_ids=[2, 3], loss_mask=[1, 1], turns=1, answer_blocks=1,
                       finish_reason="answered")  # fmt: skip
        t.reward = reward
        t.tool_calls = [ToolCallRecord(turn=0, status="ok", tool="python") for _ in range(n)]
        group.append(t)
    return rollout_metrics([group], [list(range(len(group)))], no_tool_p_err=0.5)


def _tool_use_alerts(monitor: AlertMonitor, m: dict) -> list[str]:
    return [a for a in monitor.check(m) if "tool calls per trajectory" in a]


def test_a_model_that_stops_calling_its_tool_raises_an_alert_by_default():
    monitor = AlertMonitor(LoggingConfig())  # the defaults: every run has the guard rail
    for _ in range(3):  # the early-run level: 1.5 calls per trajectory
        assert _tool_use_alerts(monitor, _step([1, 2, 1, 2])) == []
    assert _tool_use_alerts(monitor, _step([1, 1, 1, 2])) == []  # 1.25: a dip, not a drop
    m = _step([0, 0, 1, 0], reward=1.0)  # 0.25 per trajectory, 1 call (< alert_min_calls), reward up
    assert m["tools/calls"] < LoggingConfig().alert_min_calls
    (alert,) = _tool_use_alerts(monitor, m)
    assert alert.startswith("tool calls per trajectory fell to 0.25 from 1.50 in the first 3 steps")
    assert "giving up its tool" in alert
    assert monitor.should_stop(5, monitor.check(_step([0, 0, 0, 0]))) is False  # warn by default


def test_the_floor_and_the_drop_can_be_set_or_turned_off():
    floor = AlertMonitor(LoggingConfig(alert_tool_use_floor=0.5, alert_tool_use_drop=None))
    (alert,) = _tool_use_alerts(floor, _step([0, 1, 0, 0]))  # from the first step on
    assert alert.startswith("tool calls per trajectory 0.25 below the floor 0.5")
    off = AlertMonitor(LoggingConfig(alert_tool_use_drop=None))
    for calls in ([2, 2], [2, 2], [2, 2], [0, 0]):
        assert _tool_use_alerts(off, _step(calls)) == []


def test_a_run_that_never_used_the_tool_is_not_flagged_for_a_drop():
    monitor = AlertMonitor(LoggingConfig())
    for _ in range(5):
        assert _tool_use_alerts(monitor, _step([0, 0])) == []
