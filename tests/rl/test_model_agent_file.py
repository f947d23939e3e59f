"""A model directory from a stranger: its `tirl_agent.yaml` may name built-in tools only (round 5, item 4).

`tools: [module:attr]` in a downloaded model's agent file was imported when eval or chat loaded the
model's settings, running the module's import-time code. The test puts a module with an import side
effect on the path and a real model directory whose agent file names it, runs `tirl eval` on it, and
checks that the module was never imported."""

from __future__ import annotations

import shutil
import sys

import pytest
import yaml
from typer.testing import CliRunner

from tirl.agent.config import AgentConfig
from tirl.cli import app
from tirl.config import ConfigError
from tirl.rl.checkpoint import AGENT_FILE, agent_settings_warning, saved_agent_settings

MODULE = "tirl_round5_side_effect"


@pytest.fixture
def hostile_model(tiny_model_dir, tmp_path, monkeypatch):
    """A model directory naming `MODULE:Tool`, whose import writes a marker file."""
    marker = tmp_path / "imported"
    (tmp_path / f"{MODULE}.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\nTool = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / AGENT_FILE).write_text(yaml.safe_dump({"tools": [f"{MODULE}:Tool"], "max_turns": 1}))
    return model, marker


def test_eval_refuses_a_model_agent_file_naming_a_module_without_importing_it(hostile_model, tmp_path):
    model, marker = hostile_model
    data = tmp_path / "one.jsonl"
    data.write_text('{"problem": "1+1?", "answer": "2"}\n')
    args = [
        "eval",
        "--model",
        str(model),
        "--data",
        str(data),
        "--samples",
        "1",
        "--out",
        str(tmp_path / "o"),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0, result.output
    assert not marker.exists() and MODULE not in sys.modules, "the model's agent file imported a module"
    assert f"names tools that are not built in: '{MODULE}:Tool'" in result.output, result.output


def test_built_in_tools_load_and_a_foreign_one_is_refused_or_only_warned_about(hostile_model):
    model, marker = hostile_model
    (model / AGENT_FILE).write_text(yaml.safe_dump({"tools": ["execute_python_code_with_standard_io"]}))
    agent, _ = saved_agent_settings(model)
    assert agent.tools == ["execute_python_code_with_standard_io"]
    (model / AGENT_FILE).write_text(yaml.safe_dump({"tools": [f"{MODULE}:Tool"]}))
    with pytest.raises(ConfigError, match="may name built-in tools only"):
        saved_agent_settings(model)
    warning = agent_settings_warning(model, AgentConfig())  # train's preflight: a warning, not an import
    assert warning is not None and "was not loaded" in warning and f"{MODULE}:Tool" in warning
    assert not marker.exists() and MODULE not in sys.modules


def test_a_tool_the_users_own_settings_name_is_theirs_to_trust(hostile_model):
    model, _ = hostile_model
    mine = "tests.agent.lookup_tool:Lookup"  # a real user tool: trusted, it loads
    (model / AGENT_FILE).write_text(yaml.safe_dump({"tools": [mine], "max_turns": 1}))
    agent, path = saved_agent_settings(model, trusted_tools=[mine])
    assert agent.tools == [mine] and path == model / AGENT_FILE
    assert agent_settings_warning(model, AgentConfig(tools=[mine], max_turns=1)) is None  # trusted, unchanged
    (model / AGENT_FILE).write_text(yaml.safe_dump({"tools": [mine, f"{MODULE}:Tool", "other:Tool"]}))
    with pytest.raises(ConfigError) as refused:
        saved_agent_settings(model, trusted_tools=[mine])
    assert str(refused.value) == (
        f"{model / AGENT_FILE} names tools that are not built in: '{MODULE}:Tool', 'other:Tool'. An agent file "
        "saved with a model may name built-in tools only (loading one would import its module); if you "
        "trust it, name the tools in your own agent settings (--agent FILE or agent.tools)"
    )
