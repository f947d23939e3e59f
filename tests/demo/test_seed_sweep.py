"""`tirl demo --demo-seeds N`: whole demos over demo.seed (drills, SFT, RL each), resumable, with
the per-seed table and the spread in report.md."""

from __future__ import annotations

import json

import pytest
from tests.demo.test_demo import MICRO

from tirl.config import read_yaml
from tirl.demo import DemoError, run_demo_seeds
from tirl.demo.seed_sweep import seed_row, spread


def test_a_sweep_varies_demo_seed_itself_and_resumes_keeping_finished_seeds(tmp_path):
    out, quiet = tmp_path / "sweep", lambda _: None
    first = run_demo_seeds(out, 1, [*MICRO, "demo.seed=3"], progress=False, say=quiet)
    assert [r["seed"] for r in first["seeds"]] == [3] and first["seeds"][0]["drill_steps"] == 1
    assert first["seeds"][0]["shaped_drill_steps"] == 1
    # the whole pipeline under the seed: its data, its model (and drills), its RL run
    assert json.loads((out / "seed3" / "settings.json").read_text())["demo"]["seed"] == 3
    assert read_yaml(out / "seed3" / "rl" / "config.yaml")["seed"] == 3
    assert read_yaml(out / "seed3" / "drills" / "config.yaml")["seed"] == 3
    report = (out / "report.md").read_text()
    assert "# tirl demo over 1 values of demo.seed" in report and "| 3 | 1, " in report
    assert "copy drills did not learn to copy" in report  # a seed that fell short is a row, with why
    assert "shaped drills did not learn to copy" in report

    seed3 = (out / "seed3" / "summary.json").read_text()
    with pytest.raises(DemoError, match="written with other settings"):
        run_demo_seeds(out, 1, [*MICRO, "demo.seed=3", "demo.rl_steps=2"], progress=False, resume=True)
    said: list[str] = []
    again = run_demo_seeds(out, 1, [*MICRO, "demo.seed=3"], progress=False, resume=True, say=said.append)
    assert said == ["demo seed 3 [1/1]: finished before, kept"] and again == first
    assert (out / "seed3" / "summary.json").read_text() == seed3  # not run again


def test_the_spread_is_mean_interval_min_and_max_over_seeds():
    summaries = [
        {"sft_accuracy": s, "rl_accuracy": r, "wall_seconds": {"total": 600.0},
         "drills": {"steps": 300, "accuracy": 0.97, "target": 0.95}}
        for s, r in ((50.0, 70.0), (60.0, 80.0), (55.0, 81.0))
    ]  # fmt: skip
    rows = [seed_row(k, s) for k, s in enumerate(summaries)]
    assert rows[0]["drills_learned"] and rows[0]["minutes"] == 10.0
    result = spread(rows)
    assert result["sft_accuracy"]["mean"] == 55.0 and result["sft_accuracy"]["min"] == 50.0
    assert result["rl_accuracy"]["max"] == 81.0 and result["gain_points"]["mean"] == pytest.approx(22.0)
    assert result["sft_accuracy"]["low"] < 55.0 < result["sft_accuracy"]["high"]
