"""Run directories and checkpoints: restart of a run stopped before its first checkpoint, the agent
settings saved next to every checkpoint's model, and model paths that say what is wrong."""

from __future__ import annotations

import pytest

from tirl.agent.config import AgentConfig
from tirl.config import ConfigError
from tirl.rl.checkpoint import (
    AGENT_FILE,
    prepare_run_dir,
    resolve_model_path,
    save_checkpoint,
    saved_agent_settings,
)
from tirl.rl.config import TrainConfig

AGENT = AgentConfig(max_turns=4, max_response_tokens=384, system_prompt="Use the python tool.")


def _cfg(tmp_path) -> TrainConfig:
    stages = [{"steps": 2, "data": "x"}]
    return TrainConfig(model="m", output_dir=str(tmp_path), run_name="r", stages=stages, agent=AGENT)


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_stopped_before_its_first_checkpoint_starts_over(tmp_path, resume):
    cfg, said = _cfg(tmp_path), []
    assert prepare_run_dir(cfg.run_dir, cfg, resume=False, is_main=True, say=said.append) is None
    (cfg.run_dir / "metrics.jsonl").write_text('{"step": 1}\n')  # killed during step 2, no checkpoint yet
    assert prepare_run_dir(cfg.run_dir, cfg, resume=resume, is_main=True, say=said.append) is None
    assert said == [f"{cfg.run_dir} was stopped before its first checkpoint: starting it over from step 0"]
    assert not (cfg.run_dir / "metrics.jsonl").exists() and (cfg.run_dir / "config.yaml").is_file()


def test_resume_needs_a_run_and_says_which_step(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, said = _cfg(tmp_path), []
    with pytest.raises(ConfigError, match="no checkpoint and no run"):
        prepare_run_dir(cfg.run_dir, cfg, resume=True, is_main=True)
    prepare_run_dir(cfg.run_dir, cfg, resume=False, is_main=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ckpt = save_checkpoint(cfg.run_dir, 7, model, model.state_dict(), tokenizer, {"step": 7}, keep_last=2)
    assert prepare_run_dir(cfg.run_dir, cfg, resume=True, is_main=True, say=said.append) == ckpt
    assert said == [f"resuming {cfg.run_dir} from step_000007 (step 7)"]
    with pytest.raises(ConfigError, match="already holds a run: pass --resume"):
        prepare_run_dir(cfg.run_dir, cfg, resume=False, is_main=True)

    # The agent settings travel with the model: a run dir, a checkpoint and its model/ all find them.
    assert resolve_model_path(str(cfg.run_dir)) == str(ckpt / "model")
    assert resolve_model_path(str(ckpt)) == str(ckpt / "model")
    agent, path = saved_agent_settings(ckpt / "model")
    assert agent == AGENT and path == ckpt / "model" / AGENT_FILE
    assert saved_agent_settings(tiny_model_dir) is None  # a model tirl did not train


def test_model_paths_that_do_not_exist_fail_at_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for missing in (
        "runs/demo",
        "runs/demo/rl/checkpoints/step_000030/model",
        "./model",
        str(tmp_path / "m"),
    ):
        with pytest.raises(FileNotFoundError, match="no such directory"):
            resolve_model_path(missing)
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        resolve_model_path("runs")
    assert resolve_model_path("Qwen/Qwen3-14B") == "Qwen/Qwen3-14B"  # a hub id is left to the hub


def test_an_unwritable_run_directory_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = _cfg(blocker)
    with pytest.raises(ConfigError, match=r"run directory \(output_dir/run_name\) .*cannot write there"):
        prepare_run_dir(cfg.run_dir, cfg, resume=False, is_main=True)
