"""`tirl train` checks what the config alone decides before anything starts (no engine, no Ray, no
sandbox: the trainer is never called), each failure one `error:` line; and it warns when the agent
settings change the prompt of a model trained with other ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tirl.cli import app


@pytest.fixture
def config(tiny_model_dir, tmp_path) -> Path:
    data = tmp_path / "problems.jsonl"
    data.write_text(
        json.dumps({"id": "p", "problem": "What is " + "1 + " * 40 + "1?", "answer": "41"}) + "\n"
    )
    path = tmp_path / "train.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": str(tiny_model_dir),
                "output_dir": str(tmp_path / "runs"),
                "engine": {"backend": "vllm", "device": "cpu", "max_model_len": 1024},
                "agent": {"max_response_tokens": 64},
                "stages": [{"steps": 1, "data": str(data)}],
            }
        )
    )
    return path


@pytest.fixture
def trainer_calls(monkeypatch) -> list:
    """The trainer, replaced: a call means the checks let the run start."""
    calls: list = []
    monkeypatch.setattr("tirl.rl.trainer.run_training", lambda cfg, **kw: calls.append(cfg) or cfg.run_dir)
    return calls


def test_a_prompt_longer_than_max_model_len_fails_before_anything_starts(config, trainer_calls):
    result = CliRunner().invoke(app, ["train", "--config", str(config), "engine.max_model_len=32"])
    assert result.exit_code == 2, result.output
    assert "does not fit engine.max_model_len=32" in result.output and "Traceback" not in result.output
    assert result.output.startswith("error: stage 'stage': a prompt of ") and not trainer_calls


def test_missing_first_stage_data_and_a_too_small_private_ray_fail_before_anything_starts(
    config, trainer_calls
):
    result = CliRunner().invoke(app, ["train", "--config", str(config), "stages.0.data=/nowhere.jsonl"])
    assert result.exit_code == 2 and "stage 'stage': cannot load its data" in result.output, result.output
    ray = ["cluster.backend=ray", "cluster.num_cpus=1"]
    result = CliRunner().invoke(app, ["train", "--config", str(config), *ray])
    assert result.exit_code == 2 and "cluster.num_cpus=1 is fewer logical CPUs" in result.output, (
        result.output
    )
    assert not trainer_calls
    result = CliRunner().invoke(app, ["train", "--config", str(config)])
    assert result.exit_code == 0 and len(trainer_calls) == 1, result.output


def test_agent_settings_that_change_a_trained_models_prompt_are_warned_about(
    config, trainer_calls, tiny_model_dir, tmp_path
):
    import shutil

    model = tmp_path / "trained"
    shutil.copytree(tiny_model_dir, model)
    (model / "tirl_agent.yaml").write_text(yaml.safe_dump({"system_prompt": "Use the python tool."}))
    args = ["train", "--config", str(config), f"model={model}"]
    result = CliRunner().invoke(app, [*args, "agent.system_prompt=Use the python tool."])
    assert result.exit_code == 0 and "warning" not in result.output, result.output
    result = CliRunner().invoke(app, args)  # the default (the paper's) system prompt: not what it learned
    assert result.exit_code == 0, result.output
    warning = next(line for line in result.output.splitlines() if line.startswith("warning:"))
    assert "differ from the ones the model was trained with" in warning and "system_prompt:" in warning
    assert "docs/commands.md" in warning
