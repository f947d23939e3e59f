"""The rStar2 recipe configs carry the paper's numbers; `tirl data filter-hard` and `tirl train` CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tirl
from tirl.cli import app
from tirl.config import load_config
from tirl.data import Problem, load_problems
from tirl.eval.config import EvalConfig
from tirl.rl.config import SFTConfig, TrainConfig
from tirl.rl.hard import select_hard

RECIPE = Path(tirl.__file__).parent / "configs" / "rstar2"


def test_rstar2_recipe_matches_the_paper():
    sft = load_config(SFTConfig, RECIPE / "sft.yaml")
    assert (sft.epochs, sft.batch_size, sft.optim.lr, sft.optim.warmup_ratio) == (3, 128, 5e-6, 0.04)
    assert sft.optim.schedule == "cosine"
    rl = load_config(TrainConfig, RECIPE / "train.yaml")
    a = rl.algorithm
    assert (a.group_size, a.rollouts_per_prompt, a.prompts_per_step) == (16, 32, 512)
    assert (a.roc, a.eps_low, a.eps_high, a.kl_coef, a.entropy_coef) == ("sample", 0.2, 0.28, 0.0, 0.0)
    assert (rl.optim.lr, rl.optim.warmup_steps, rl.optim.schedule) == (1e-6, 20, "constant")
    assert [s.steps for s in rl.stages] == [300, 85, 125] and rl.total_steps == 510
    assert [s.max_response_tokens for s in rl.stages] == [8192, 12288, 12288]
    assert [s.max_turns for s in rl.stages] == [10, 10, 15]
    assert rl.agent.temperature == 1.0 and rl.engine.backend == "vllm"
    ev = load_config(EvalConfig, RECIPE / "eval.yaml")
    assert (ev.samples, ev.temperature, ev.max_turns, ev.max_tokens) == (16, 0.6, 30, 30000)


def test_select_hard_drops_problems_solved_every_time():
    problems = [Problem(f"p{i}", f"q{i}", "1") for i in range(4)]
    hard = select_hard(problems, [8, 7, 0, 8], 8)
    assert [p.id for p in hard] == ["p1", "p2"]
    assert [p.meta["solved"] for p in hard] == ["7/8", "0/8"]


def test_filter_hard_cli_runs_real_rollouts(tiny_model_dir, tmp_path):
    data = tmp_path / "problems.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "problem": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
            for i in range(3)
        )
    )
    out = tmp_path / "hard.jsonl"
    args = [
        "data",
        "filter-hard",
        "--checkpoint",
        str(tiny_model_dir),
        "--data",
        str(data),
        "-k",
        "2",
        "--out",
        str(out),
    ]
    args += [
        "agent.max_response_tokens=12",
        "sandbox.mode=inprocess",
        "engine.device=cpu",
        "reward.workers=1",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "kept 3 of 3" in result.output  # an untrained model solves nothing
    assert [p.meta["solved"] for p in load_problems(out)] == ["0/2"] * 3


def test_train_cli_reports_bad_config(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: m\nstages: [{steps: 1, data: x}]\nalgorithm: {eps_lo: 0.1}\n")
    result = CliRunner().invoke(app, ["train", "--config", str(bad)])
    assert result.exit_code == 2 and "algorithm.eps_lo" in result.output
    result = CliRunner().invoke(app, ["train", "--config", str(bad), "optim.lr=abc"])
    assert result.exit_code == 2 and "optim.lr" in result.output


@pytest.mark.parametrize("name", ["sft.yaml", "train.yaml", "eval.yaml"])
def test_recipe_files_are_documented(name):
    text = (RECIPE / name).read_text()
    assert text.startswith("# rStar2-Agent") and "docs/method.md" in text
