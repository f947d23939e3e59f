"""Configs: what the docs write on the command line means what they say (YAML 1.2 spellings), section
files, and one-line errors that name the key."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import tirl
from tirl.agent.config import AgentConfig
from tirl.config import ConfigError, apply_overrides, ensure_writable_dir, load_config
from tirl.rl.config import TrainConfig

BASE = ["model=m", "stages=[{steps: 1, data: x}]"]


def test_documented_enum_spellings_are_strings_and_booleans_still_parse():
    cfg = load_config(TrainConfig, None, [*BASE, "algorithm.roc=off", "algorithm.drop_uniform_groups=on"])
    assert cfg.algorithm.roc == "off" and cfg.algorithm.drop_uniform_groups is True
    cfg = load_config(TrainConfig, None, [*BASE, "algorithm.drop_uniform_groups=no", "optim.lr=1e-6"])
    assert cfg.algorithm.drop_uniform_groups is False and cfg.optim.lr == 1e-6
    assert apply_overrides({}, ["xs=[1, 2.5, true]", "n=1e3"]) == {"xs": [1, 2.5, True], "n": 1000.0}


def test_a_yaml_file_reads_off_as_the_string_off(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("model: m\nstages: [{steps: 1, data: x}]\nalgorithm: {roc: off}\n")
    assert load_config(TrainConfig, path).algorithm.roc == "off"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "algorithm.roc=of",
            r"algorithm\.roc: Input should be 'sample', 'topk' or 'off' \(got 'of'\)",
        ),
        ("optim.lr=", r"override 'optim.lr=' has no value"),
        ("optim.lr=fast", r"optim\.lr: .*\(got 'fast'\)"),
        ("=3", "must look like key.path=value"),
    ],
)
def test_bad_values_name_the_key_and_the_value(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, None, [*BASE, override])


def test_missing_required_value_says_how_to_set_it():
    with pytest.raises(ConfigError, match="stages: required: set it in the config or as key=value"):
        load_config(TrainConfig, None, ["model=m"])


def test_a_section_may_name_a_yaml_file_beside_the_config(tmp_path):
    (tmp_path / "agent.yaml").write_text("max_turns: 3\nsystem_prompt: Use the python tool.\n")
    (tmp_path / "train.yaml").write_text("model: m\nstages: [{steps: 1, data: x}]\nagent: agent.yaml\n")
    cfg = load_config(TrainConfig, tmp_path / "train.yaml", ["agent.max_turns=5"])
    assert cfg.agent == AgentConfig(max_turns=5, system_prompt="Use the python tool.")
    (tmp_path / "bad.yaml").write_text("model: m\nstages: [{steps: 1, data: x}]\nagent: nowhere.yaml\n")
    with pytest.raises(
        ConfigError, match=r"agent: nowhere\.yaml names .*nowhere\.yaml, which does not exist"
    ):
        load_config(TrainConfig, tmp_path / "bad.yaml")


def test_a_demo_config_copied_elsewhere_says_where_its_section_file_is_in_one_line(tmp_path):
    demo = Path(tirl.__file__).parent / "configs" / "demo"
    copy = tmp_path / "mytrain.yaml"
    shutil.copy(demo / "train.yaml", copy)
    with pytest.raises(ConfigError) as raised:
        load_config(TrainConfig, copy)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(
        f"{copy}: agent: agent.yaml names {tmp_path / 'agent.yaml'}"
    )
    assert message.endswith(f"write its path: agent: {demo / 'agent.yaml'})"), message
    copy.write_text(copy.read_text().replace("agent: agent.yaml", f"agent: {demo / 'agent.yaml'}"))
    assert load_config(TrainConfig, copy).agent.max_turns > 0  # the line's advice, followed, loads


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ("optim.lrr=1", "optim.lrr: Extra inputs are not permitted (got 1); did you mean 'lr'?"),
        ("enigne.device=cpu", "enigne: Extra inputs are not permitted; did you mean 'engine'?"),
        ("stages.0.stepz=3", "stages.0.stepz: Extra inputs are not permitted (got 3); did you mean 'steps'?"),
        (
            "optim.lora.rnak=8",
            "optim.lora.rnak: Extra inputs are not permitted (got 8); did you mean 'rank'?",
        ),
        ("optim.zzz=1", "optim.zzz: Extra inputs are not permitted (got 1)\n"),  # nothing close: no guess
    ],
)
def test_an_unknown_key_gets_did_you_mean_from_its_own_section(override, hint):
    with pytest.raises(ConfigError) as raised:
        load_config(TrainConfig, None, [*BASE, override])
    assert f"  {hint}" in f"{raised.value}\n", str(raised.value)


def test_unwritable_output_is_found_before_any_work(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"--out .*cannot write there"):
        ensure_writable_dir(blocker / "eval", "--out")
    assert ensure_writable_dir(tmp_path / "x" / "y", "--out").is_dir()


def test_a_number_in_an_override_indexes_a_list(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("model: m\nstages: [{steps: 1, data: x}, {steps: 2, data: y}]\n")
    cfg = load_config(TrainConfig, path, ["stages.0.steps=3", "stages.-1.data=z", "stages.1.name=hard"])
    assert [(s.steps, s.data, s.name) for s in cfg.stages] == [(3, "x", "stage"), (2, "z", "hard")]
    cfg = load_config(TrainConfig, path, ["stages.1={steps: 7, data: w}"])
    assert (cfg.stages[1].steps, cfg.stages[1].data) == (7, "w")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "stages.2.steps=3",
            r"stages\.2 does not exist \(stages has 1 entry, from 0\); .*set the whole list",
        ),
        ("stages.first.steps=3", r"stages is a list: index it by number \(0\.\.0\), not 'first'"),
        ("stages.0.steps.x=3", r"stages\.0\.steps is a value \(1\), not a section or a list"),
    ],
)
def test_a_bad_list_index_says_which_entries_exist(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, None, [*BASE, override])


def test_bad_yaml_names_the_file_and_line_in_one_line(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("model: m\nstages:\n  - steps: 1\n   data: x\n")
    with pytest.raises(ConfigError) as raised:
        load_config(TrainConfig, path)
    message = str(raised.value)
    assert message.startswith(f"{path}:4:4: not valid YAML: ") and "\n" not in message, message
    assert "<unicode string>" not in message
