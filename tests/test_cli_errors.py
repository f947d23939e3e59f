"""One error style for the `tirl` command (the console script's `main`, run as a user runs it): a usage
error, a config error and a bad YAML file are each one `error:` line on stderr, exit status 2, no box and
no traceback; `tirl` alone prints its help."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _tirl(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "tirl.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["train"], "error: missing option '--config' / '-c' (see `python -m tirl.cli train --help`)"),
        (
            ["trian"],
            "error: no such command 'trian'. Did you mean 'train'? (see `python -m tirl.cli --help`)",
        ),
        (
            ["eval", "--model", "m", "--data", "d", "--samples", "0"],
            "error: invalid value for '--samples': Input should be greater than or equal to 1 "
            "(see `python -m tirl.cli eval --help`)",
        ),
    ],
)
def test_usage_errors_are_one_error_line(args, line):
    done = _tirl(*args)
    assert done.returncode == 2 and done.stderr.strip() == line, done.stderr
    assert done.stdout == ""


def test_config_errors_are_one_error_line_naming_the_file_and_the_known_names(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: m\nstages:\n  - steps: 1\n   data: x\n")
    done = _tirl("sft", "--config", str(bad))
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {bad}:4:4: not valid YAML: ") and done.stderr.count("\n") == 1
    good = tmp_path / "train.yaml"
    good.write_text("model: m\nstages: [{steps: 1, data: x}]\n")
    done = _tirl("train", "--config", str(good), "algorithm.policy_loss=grpoo")
    assert done.returncode == 2 and "unknown policy loss 'grpoo': use one of grpo, gspo" in done.stderr
    assert "Traceback" not in done.stderr and "╭" not in done.stderr


def test_tirl_alone_prints_its_help():
    done = _tirl()
    assert done.returncode == 0 and "Commands" in done.stdout and done.stderr == ""


def test_train_and_sft_help_name_config_paths_that_exist():
    from typer.testing import CliRunner

    from tirl.cli import app

    root = Path(SRC).parent
    for command, name in (("train", "train"), ("sft", "sft")):
        shown = CliRunner().invoke(app, [command, "--help"], terminal_width=200).output
        assert (
            f"src/tirl/configs/rstar2/{name}.yaml" in shown
            and (root / f"src/tirl/configs/rstar2/{name}.yaml").is_file()
        )
    assert "stages.0.steps=3" in CliRunner().invoke(app, ["train", "--help"], terminal_width=200).output
