"""Asynchronous GRPO-RoC is safe by default: the off-policy correction is on unless the user opts out (then
a warning says what happens), the temperature/top-p requirement is explained, and the off-policy guard
rails (engine log-prob gap, length-limit share, TIS truncation, approx KL) alert and can stop the run,
naming the last good checkpoint."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from pydantic import ValidationError

from tirl.config import load_config
from tirl.rl.config import ASYNC_TIS_CAP, AlgorithmConfig, LoggingConfig, TrainConfig, UncorrectedAsyncWarning
from tirl.rl.metrics import AlertMonitor, stop_message

STAGES = [{"steps": 1, "data": "x"}]
ASYNC = {"async": True, "max_staleness": 1}


def _quiet(**kw) -> AlgorithmConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these may warn
        return AlgorithmConfig(**kw)


def test_async_gets_the_off_policy_correction_by_default():
    alg = _quiet(**ASYNC)
    assert alg.tis_cap == ASYNC_TIS_CAP == 2.0 and alg.tis_defaulted
    assert _quiet(**ASYNC, tis_cap=3.0).tis_cap == 3.0  # the user's cap is kept
    assert not _quiet(**ASYNC, tis_cap=3.0).tis_defaulted
    assert _quiet().tis_cap is None  # synchronous: the paper's recipe, no correction
    assert _quiet(**{"async": True, "max_staleness": 0}).tis_cap is None  # k = 0 is the synchronous step
    # survives a dump and reload (a resumed run's saved config)
    assert AlgorithmConfig.model_validate(alg.model_dump(by_alias=True)).tis_cap == 2.0


def test_the_default_reaches_the_cli_config(tmp_path):
    cfg = load_config(TrainConfig, None, ["model=m", "stages=[{steps: 1, data: x}]", "algorithm.async=true"])
    assert cfg.algorithm.tis_cap == 2.0


@pytest.mark.parametrize("off", [None, "off", "null"])
def test_opting_out_warns_what_happens(off):
    with pytest.warns(UncorrectedAsyncWarning, match=r"NO off-policy correction.*biased.*60\.9% to 0%"):
        alg = AlgorithmConfig(**ASYNC, tis_cap=off)
    assert alg.tis_cap is None


def test_opting_out_from_the_command_line_warns():
    with pytest.warns(UncorrectedAsyncWarning, match="max_staleness=2"):
        cfg = load_config(
            TrainConfig,
            None,
            [
                "model=m",
                "stages=[{steps: 1, data: x}]",
                "algorithm.async=true",
                "algorithm.max_staleness=2",
                "algorithm.tis_cap=null",
            ],
        )
    assert cfg.algorithm.tis_cap is None


def test_the_temperature_requirement_is_explained():
    with pytest.raises(ValidationError, match=r"turns on the off-policy correction.*by default") as err:
        TrainConfig(model="m", stages=STAGES, algorithm=ASYNC, agent={"temperature": 0.8})
    text = str(err.value)
    assert "temperature=1.0 and agent.top_p=1.0" in text and "distribution it sampled from" in text
    assert "algorithm.tis_cap=null" in text
    with pytest.raises(ValidationError, match=r"algorithm.tis_cap=2.0 \(truncated importance sampling\)"):
        TrainConfig(model="m", stages=STAGES, algorithm={"tis_cap": 2.0}, agent={"top_p": 0.9})
    with pytest.warns(UncorrectedAsyncWarning):  # opting out is the other way
        TrainConfig(
            model="m", stages=STAGES, algorithm={**ASYNC, "tis_cap": None}, agent={"temperature": 0.8}
        )


def test_exact_staleness_needs_async():
    assert _quiet(**ASYNC, staleness_mode="exact").exact_staleness
    assert not _quiet(staleness_mode="exact").exact_staleness
    with pytest.raises(ValidationError):
        AlgorithmConfig(staleness_mode="sometimes")


# --- guard rails ------------------------------------------------------------------------------------

HEALTHY = {
    "train/engine_logprob_gap": 0.006,
    "finish/length": 0.05,
    "train/tis_truncated_frac": 0.001,
    "train/approx_kl": 0.002,
    "train/ratio_max": 4.0,
}
# step 16 of the collapsed async run without correction (the numbers)
COLLAPSED = {"train/engine_logprob_gap": 0.2, "finish/length": 0.96, "train/approx_kl": 0.3}


def test_the_off_policy_signals_alert():
    monitor = AlertMonitor(LoggingConfig())
    assert monitor.check(HEALTHY) == []
    alerts = monitor.check(COLLAPSED)
    assert len(alerts) == 3
    assert alerts[0].startswith("engine-trainer log-prob gap 0.200 nats/token (limit 0.05)")
    assert alerts[1] == "96% of rollouts hit the length limit (limit 50%)"
    assert alerts[2].startswith("approx KL 0.300")
    assert monitor.check({"train/tis_truncated_frac": 0.2})[0].startswith("TIS truncated 20.0% of tokens")
    assert AlertMonitor(LoggingConfig(alert_ratio_max=5.0)).check(HEALTHY) == []
    assert AlertMonitor(LoggingConfig(alert_ratio_max=3.0)).check(HEALTHY) == [
        "importance ratio max 4.0 (limit 3.0)"
    ]


def test_an_off_policy_limit_can_be_turned_off_and_the_gap_needs_comparable_logprobs():
    assert (
        AlertMonitor(LoggingConfig(alert_engine_logprob_gap=None)).check({"train/engine_logprob_gap": 9.0})
        == []
    )
    # at temperature != 1 the engine's log-probs are of another distribution: the gap is large by design
    assert (
        AlertMonitor(LoggingConfig(), comparable_logprobs=False).check({"train/engine_logprob_gap": 9.0})
        == []
    )


def test_the_tool_alert_still_counts_with_the_off_policy_ones():
    m = {"tools/calls": 40, "tools/error_ratio": 1.0, "finish/length": 0.96}
    assert AlertMonitor(LoggingConfig()).check(m) == [
        "tool error ratio 100.0%",
        "96% of rollouts hit the length limit (limit 50%)",
    ]


def test_stop_after_consecutive_alerting_steps():
    warn = AlertMonitor(LoggingConfig())
    assert not any(warn.should_stop(s, ["x"]) for s in range(1, 10))  # warn: never stops
    stop = AlertMonitor(LoggingConfig(alert_action="stop", alert_stop_after=2))
    assert not stop.should_stop(14, ["x"])
    assert not stop.should_stop(15, [])  # a clean step resets the streak
    assert not stop.should_stop(16, ["x"]) and stop.streak_start == 16
    assert stop.should_stop(17, ["x"])


def _checkpoints(run_dir: Path, steps: list[int]) -> None:
    for s in steps:
        (run_dir / "checkpoints" / f"step_{s:06d}" / "model").mkdir(parents=True)


def test_the_stop_message_names_the_last_good_checkpoint(tmp_path):
    _checkpoints(tmp_path, [5, 10, 16])  # step 16's checkpoint was written while the alerts went on
    text = stop_message(tmp_path, 17, 16, ["96% of rollouts hit the length limit (limit 50%)"])
    assert "after alerts on steps 16-17: 96% of rollouts hit the length limit" in text
    assert f"The last good checkpoint is {tmp_path / 'checkpoints' / 'step_000010'}" in text
    assert "logging.alert_action=warn" in text
    assert "No checkpoint was written before the alerts" in stop_message(tmp_path, 3, 3, ["x"])


def test_the_trainer_reports_then_stops_with_the_message(tmp_path):
    """The trainer's report: alerts printed and logged with the step; the second alerting step in a row
    returns the stop message (the trainer raises TrainingStopped with it on every rank)."""
    from types import SimpleNamespace

    from rich.console import Console

    from tirl.rl.metrics import MetricsLogger, read_metrics
    from tirl.rl.trainer import TrainerState, _report

    logging = LoggingConfig(tensorboard=False, alert_action="stop", alert_stop_after=2)
    run = SimpleNamespace(
        cfg=SimpleNamespace(run_dir=tmp_path),
        state=TrainerState(),
        alerts=AlertMonitor(logging),
        logger=MetricsLogger(tmp_path, logging),
    )
    _checkpoints(tmp_path, [10])
    stage, console = SimpleNamespace(name="s", steps=30), Console(record=True, width=400)
    row = {
        "reward/mean": 0.0,
        "response/length_mean": 384,
        "tools/calls_per_traj": 1.0,
        "tools/error_ratio": 1.0,
        "train/loss": 0.1,
        "time/step_s": 1.0,
    }
    stops = []
    for step, m in ((15, HEALTHY), (16, COLLAPSED), (17, COLLAPSED)):
        run.state.step = run.state.stage_step = step
        stops.append(_report(run, stage, {**row, **m}, console))
    assert stops[:2] == [None, None] and "steps 16-17" in stops[2]
    assert str(tmp_path / "checkpoints" / "step_000010") in stops[2]
    logged = read_metrics(tmp_path)
    assert [len(r.get("alerts", [])) for r in logged] == [0, 3, 3]
    text = console.export_text()
    assert "STOP:" in text and "ALERT step 16:" in text


def test_the_run_says_which_correction_it_trains_with():
    from rich.console import Console

    from tirl.rl.trainer import _announce_correction

    def said(algorithm: dict) -> str:
        console = Console(record=True, width=400)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _announce_correction(TrainConfig(model="m", stages=STAGES, algorithm=algorithm), console)
        return console.export_text()

    assert "TIS with cap 2.0 (the async default; algorithm.tis_cap=null turns it off)" in said(ASYNC)
    assert "WARNING: algorithm.async=true with algorithm.tis_cap=null" in said({**ASYNC, "tis_cap": None})
    assert said({}) == ""
