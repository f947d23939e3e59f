"""One error style for the `tirl` command (the console script's `main`, run as a user runs it): a usage
error, a config error and a bad YAML file are each one `error:` line on stderr, exit status 2, no box and
no traceback; `tirl` alone prints its help."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tests.terminal import run_tirl, tirl_env
from tests.train_config import write_train_config

SRC = str(Path(__file__).resolve().parents[1] / "src")
# How the tests start tirl (tests.terminal: `python -m tirl.cli`), so the commands tirl prints to run next.
TIRL = shlex.join([sys.executable, "-m", "tirl.cli"])


def _tirl(*args: str) -> subprocess.CompletedProcess:
    return run_tirl(*args, timeout=300)


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["train"], f"error: missing option '--config' / '-c' (see `{TIRL} train --help`)"),
        (
            ["trian"],
            f"error: no such command 'trian'. Did you mean 'train'? (see `{TIRL} --help`)",
        ),
        (
            ["eval", "--model", "m", "--data", "d", "--samples", "0"],
            "error: invalid value for '--samples': Input should be greater than or equal to 1 "
            f"(see `{TIRL} eval --help`)",
        ),
    ],
)
def test_usage_errors_are_one_error_line(args, line):
    done = _tirl(*args)
    assert done.returncode == 2 and done.stderr.strip() == line, done.stderr
    assert done.stdout == ""


def test_sandbox_serve_names_a_preload_it_cannot_import():
    """One line before any slot starts (a zygote that cannot import its preload would die with a traceback)."""
    done = _tirl("sandbox", "serve", "--port", "0", "--preload", "math, no_such_mod")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == "error: preload: no module named 'no_such_mod' on this machine"


def test_the_console_script_names_itself_as_invoked_in_its_hints():
    """`.venv/bin/tirl train` (tirl not on PATH) points at `.venv/bin/tirl train --help`, which runs."""
    script = Path(sys.executable).parent / "tirl"
    if not script.is_file():
        pytest.skip(f"no console script beside {sys.executable} (tirl is not installed in this environment)")
    root = Path(SRC).parent
    invoked = os.path.relpath(script, root)  # as a user types it from the checkout
    done = subprocess.run(
        [invoked, "train"], cwd=root, env=tirl_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"error: missing option '--config' / '-c' (see `{invoked} train --help`)"
    shown = subprocess.run(
        [*shlex.split(f"{invoked} train --help")],
        cwd=root,
        env=tirl_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert shown.returncode == 0 and f"Usage: {invoked} train" in shown.stdout, shown.stdout[:500]


def test_a_file_given_as_the_model_is_one_error_line():
    """`model=<a file>` (relative, so not taken for a hub id's local path before): one line, as eval's;
    before, transformers read the file as a config.json and the trainer printed a 196-line traceback."""
    train = Path(SRC) / "tirl" / "configs" / "demo" / "train.yaml"
    done = _tirl("train", "--config", str(train), "model=pyproject.toml", "engine.backend=hf")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert done.stderr.startswith(
        "error: model pyproject.toml: a file, not a directory; give a model directory"
    )
    done = _tirl("eval", "--model", "pyproject.toml", "--data", "aime24")
    assert done.returncode == 2 and done.stderr.startswith("error: model pyproject.toml: a file, not"), (
        done.stderr
    )


def test_the_command_to_run_next_is_the_tirl_that_ran():
    """A printed resume command starts with the tirl this process is (`tirl` alone may not be on PATH)."""
    from tirl.cli import tirl_command

    assert tirl_command(".venv/bin/tirl", "/x/python") == [".venv/bin/tirl"]
    assert tirl_command("/opt/venv/bin/tirl", "/x/python") == ["/opt/venv/bin/tirl"]  # found on PATH
    assert tirl_command(f"{SRC}/tirl/cli.py", "/x/python") == ["/x/python", "-m", "tirl.cli"]


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


def _alerting_config(tmp_path: Path, model_dir: Path) -> Path:
    """A run whose every step alerts (any rollout cut by the length limit) and that stops on the second."""
    return write_train_config(
        tmp_path,
        model_dir,
        steps=5,
        agent={"max_turns": 1, "max_response_tokens": 4},
        optim={"device": "cpu", "lr": 1e-4},
        logging={
            "tensorboard": False,
            "alert_action": "stop",
            "alert_stop_after": 2,
            "alert_length_limit_share": 1e-6,
        },
    )


@pytest.mark.timeout(900)  # two short training runs on a loaded 2-core machine
def test_a_run_stopped_by_its_alerts_says_what_alerted_and_the_command_that_goes_on(tiny_model_dir, tmp_path):
    """logging.alert_action=stop: no traceback, a non-zero exit, what alerted, that no checkpoint came
    before the alerts (step 1's was written while they went on), and a command that runs."""
    config = _alerting_config(tmp_path, tiny_model_dir)
    done = run_tirl("train", "--config", str(config), "seed=3", timeout=420)  # a loaded machine: minutes
    assert done.returncode == 1, (done.stdout + done.stderr)[-3000:]
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()[-3:]
    run_dir = tmp_path / "runs" / "r"
    assert (
        lines[0].startswith(
            f"error: training stopped (logging.alert_action=stop) after alerts on steps 1-2 of {run_dir}: "
        )
        and "of rollouts hit the length limit" in lines[0]
    ), done.stderr[-3000:]
    assert lines[1].startswith(f"no checkpoint was written before step 1: start over from {tiny_model_dir}")
    again = f"{TIRL} train --config {config} seed=3 run_name=r-retry optim.lr=5e-05"
    assert lines[2] == f"  {again}", lines
    assert (run_dir / "checkpoints" / "step_000001").is_dir()  # written during the alerts: not offered
    # The command it gives runs as printed (and, on these settings, stops the same way, in its own
    # directory).
    done = subprocess.run(shlex.split(again), env=tirl_env(), capture_output=True, text=True, timeout=420)
    assert done.returncode == 1 and "after alerts on steps 1-2 of " in done.stderr, done.stderr[-3000:]
    assert (tmp_path / "runs" / "r-retry" / "checkpoints" / "step_000001").is_dir()


def test_a_stopped_run_with_a_checkpoint_before_the_alerts_goes_on_from_it(
    tiny_model_dir, tmp_path, monkeypatch
):
    """The stop after a clean stretch: the newest checkpoint before the first alerting step is offered
    (not step 16's, written while the alerts went on), as the model of a new run."""
    from typer.testing import CliRunner

    import tirl.rl.trainer
    from tirl.cli import app
    from tirl.rl.metrics import TrainingStopped

    config = _alerting_config(tmp_path, tiny_model_dir)  # the run itself is stood in for below
    run_dir = tmp_path / "runs" / "r"

    def stopped_at_17(cfg, resume: bool, progress: bool):
        for step in (5, 10, 16):
            (run_dir / "checkpoints" / f"step_{step:06d}" / "model").mkdir(parents=True)
        alerts = {16: ["approx KL 0.300 per token"], 17: ["approx KL 0.400 per token", "TIS truncated 9%"]}
        rows = [{"step": s, **({"alerts": alerts[s]} if s in alerts else {})} for s in range(1, 18)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        raise TrainingStopped("stopped by logging.alert_action=stop after alerts on steps 16-17")

    monkeypatch.setattr(tirl.rl.trainer, "run_training", stopped_at_17)
    done = CliRunner().invoke(app, ["train", "--config", str(config), "optim.lr=1e-6"], terminal_width=400)
    good = run_dir / "checkpoints" / "step_000010"
    assert done.exit_code == 1 and "Traceback" not in done.output, done.output
    assert (
        f"after alerts on steps 16-17 of {run_dir}: approx KL 0.400 per token; TIS truncated 9%\n"
        f"the last good checkpoint is {good}: go on from it with half the learning rate"
    ) in done.output
    assert (
        f"  {TIRL} train --config {config} optim.lr=1e-6 model={good} run_name=r-from-step_000010 optim.lr=5e-07"
    ) in done.output


def test_config_arguments_are_checked_before_torch_loads():
    """A missing config file or an override without `=` fails in the time `--help` takes: the check runs
    before the command imports its schema (and with it torch, seconds of CPU on a small machine)."""
    probe = (
        "import sys\n"
        "from tirl.cli import app\n"
        "print(app(sys.argv[1:], standalone_mode=False), 'torch' in sys.modules)\n"
    )
    train = str(Path(SRC) / "tirl" / "configs" / "demo" / "train.yaml")
    for args in (["train", "--config", "nope.yaml"], ["sft", "--config", train, "optim.lr"]):
        done = subprocess.run(
            [sys.executable, "-c", probe, *args], env=tirl_env(), capture_output=True, text=True, timeout=120
        )
        assert done.stdout.split() == ["2", "False"], (done.stdout, done.stderr)


def test_an_override_error_names_the_command_line_not_the_file():
    """The file is valid: the error says the command-line override is wrong, and which one."""
    train = Path(SRC) / "tirl" / "configs" / "demo" / "train.yaml"
    done = _tirl("train", "--config", str(train), "optim.lrr=1")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "error: invalid command-line override optim.lrr=1:",
        "  optim.lrr: Extra inputs are not permitted (got 1); did you mean 'lr'?",
    ]


def test_a_config_error_beside_an_override_names_both(tmp_path):
    from tirl.config import ConfigError, load_config
    from tirl.rl.config import TrainConfig

    bad = tmp_path / "train.yaml"
    bad.write_text("model: m\nstages: [{steps: 1, data: x}]\noptim: {lrr: 1}\n")
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, bad, ["algorithm.group_size=x"])
    lines = str(e.value).splitlines()
    assert lines[0] == f"invalid config in {bad} and its command-line override algorithm.group_size=x:"
    assert {line.split(":")[0] for line in lines[1:]} == {"  algorithm.group_size", "  optim.lrr"}


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--kind", "foo"], "error: invalid value for '--kind': 'foo': choose one of train, sft, auto"),
        (["--gpus", "0"], "error: invalid value for '--gpus': 0: a plan needs at least one GPU"),
        (["--gpu-memory", "0"], "error: invalid value for '--gpu-memory': 0: GiB per GPU must be positive"),
    ],
)
def test_plan_checks_its_own_flags(args, says):
    config = str(Path(SRC) / "tirl" / "configs" / "rstar2" / "train.yaml")
    done = _tirl("plan", "--config", config, "--arch", "qwen3-14b", *args)
    assert done.returncode == 2 and done.stderr.startswith(says) and done.stderr.count("\n") == 1, done.stderr


def test_plan_without_arch_for_a_model_not_made_yet_says_to_pass_arch():
    """The recipe's model (runs/rstar2/sft) exists after SFT: the error names --arch, not `tirl model init`
    (a tiny model would plan the wrong architecture)."""
    done = _tirl("plan", "--config", str(Path(SRC) / "tirl" / "configs" / "rstar2" / "train.yaml"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: the config's model runs/rstar2/sft is not a directory (yet): plan")
    assert "--arch (qwen3-0.6b" in done.stderr and "model init" not in done.stderr


def test_plan_says_what_it_measures_and_shows_progress(tiny_model_dir):
    config = str(Path(SRC) / "tirl" / "configs" / "rstar2" / "train.yaml")
    done = _tirl("plan", "--config", config, "--arch", str(tiny_model_dir), "--gpus", "1")
    lines = done.stderr.splitlines()
    assert lines[0].startswith(f"planning {tiny_model_dir} (") and "on an idle core" in lines[0], lines
    assert any(
        line.startswith("  measured a training step of 2 x 16384 tokens per micro-batch") for line in lines
    )
    assert "FITS" in done.stdout or "DOES NOT FIT" in done.stdout, done.stdout


def test_the_help_points_to_the_quick_demo_first():
    from typer.testing import CliRunner

    from tirl.cli import app

    for args in ([], ["demo"]):
        shown = CliRunner().invoke(app, [*args, "--help"], terminal_width=400).output
        assert "--quick" in shown and "about 3" in shown, shown[:800]
