"""Each demo phase checks its own outcome: a demo whose drills did not learn to copy, or whose SFT
model is useless, stops there with one line (demo.checks=stop) instead of running RL for nothing."""

from __future__ import annotations

import json

import pytest
from tests.demo.test_demo import MICRO

from tirl.demo.checks import Checks, DemoShortfall, rl_shortfall, sft_shortfall
from tirl.demo.pipeline import run_demo

STOP = [o for o in MICRO if o != "demo.checks=warn"] + ["demo.checks=stop"]


def test_a_demo_whose_drills_did_not_learn_to_copy_stops_after_them(tmp_path):
    out = tmp_path / "demo"
    with pytest.raises(DemoShortfall) as e:
        run_demo(out, overrides=STOP, progress=False)  # 1 drill step: no copy skill
    message = str(e.value)
    assert message.startswith("copy drills did not learn to copy") and "\n" not in message
    assert list(json.loads((out / "phases.json").read_text())) == ["traces", "drills"]
    assert not (out / "sft").exists()


def test_a_demo_whose_shaped_drills_fell_short_stops_after_them(tmp_path):
    out = tmp_path / "demo"
    with pytest.raises(DemoShortfall) as e:  # the copy drills skipped, 1 shaped drill step: no skill
        run_demo(out, overrides=[*STOP, "demo.drill_steps=0"], progress=False)
    message = str(e.value)
    assert message.startswith("shaped drills did not learn to copy") and "\n" not in message
    assert "raise demo.shaped_drill_steps" in message
    # a skipped phase (the copy drills) has nothing to resume: not recorded
    assert list(json.loads((out / "phases.json").read_text())) == ["traces", "shaped_drills"]
    assert not (out / "sft").exists()


def test_a_useless_sft_model_is_named_in_one_line_before_rl(tmp_path):
    out = tmp_path / "demo"
    with pytest.raises(DemoShortfall) as e:
        # no drills: no check
        run_demo(out, overrides=[*STOP, "demo.drill_steps=0", "demo.shaped_drill_steps=0"], progress=False)
    message = str(e.value)
    assert message.startswith("the SFT model is useless: it calls the tool in") and "\n" not in message
    # both drills skipped: not recorded
    assert list(json.loads((out / "phases.json").read_text())) == ["traces", "sft", "eval_sft"]
    assert not (out / "rl").exists()


def test_the_sft_and_rl_checks_and_what_warn_does():
    good = {"tool_use_rate": 80.0, "accuracy": 55.0}
    assert sft_shortfall(good, 50.0, 10.0) is None
    assert "calls the tool in 20.0%" in sft_shortfall(good | {"tool_use_rate": 20.0}, 50.0, 10.0)
    assert "solves 3.4%" in sft_shortfall(good | {"accuracy": 3.4}, 50.0, 10.0)
    assert rl_shortfall(50.0, 60.0) is None
    assert rl_shortfall(50.0, 50.0).startswith("RL did not beat SFT: held-out accuracy 50.0% -> 50.0%")
    said: list[str] = []
    warn = Checks("warn", said.append)
    warn.expect(None)
    warn.expect("the drills fell short")
    assert warn.warnings == ["the drills fell short"] and said == ["warning: the drills fell short"]
    stop = Checks("stop", said.append)
    stop.expect("RL did not beat SFT", stops=False)  # nothing left to stop: a warning
    with pytest.raises(DemoShortfall, match="the drills fell short"):
        stop.expect("the drills fell short")
