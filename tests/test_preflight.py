"""`tirl train` checks what the config alone decides before anything starts (no engine, no Ray, no
sandbox: the trainer is never called), each failure one `error:` line; and it warns when the agent
settings change the prompt of a model trained with other ones."""

from __future__ import annotations

import json
import os
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


# ---- the memory plan before a run on GPUs (tirl.rl.plan: its CUDA-only branch) ----


@pytest.fixture
def a_gpu(monkeypatch):
    """What CUDA reports on a machine with 24 GiB GPUs, on this CPU-only one."""
    from types import SimpleNamespace

    import torch

    from tirl.rl.plan import GiB

    gpus = [SimpleNamespace(total_memory=24 * GiB)]  # one GPU: cuda:0 (other indices do not exist)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", gpus.__getitem__)
    return 24 * GiB


def _train_config(config: Path, *overrides: str):
    from tirl.config import load_config
    from tirl.rl.config import TrainConfig

    return load_config(TrainConfig, config, list(overrides))


@pytest.mark.parametrize(
    "overrides,world_size,expected",
    [
        ((), "1", (1, True, True)),  # one process: engine and trainer on cuda:0
        ((), "8", (8, True, True)),  # torchrun --nproc_per_node=8, backend local: colocated
        (("cluster.backend=ray", "cluster.trainer.ranks=64"), "1", (64, False, False)),  # Ray, separate
        (
            ("cluster.backend=ray", "cluster.trainer.ranks=2", "engine.num_engines=2", "cluster.colocate=true"),
            "1",
            (2, True, True),
        ),
        (
            (
                "cluster.backend=ray", "cluster.trainer.ranks=4", "algorithm.async=true",
                "engine.enable_sleep_mode=false", "algorithm.tis_cap=null",
            ),
            "1",
            (4, False, False),
        ),  # async: engines never sleep, the trainer never offloads
    ],
)  # fmt: skip
def test_the_preflight_plans_the_cluster_it_is_about_to_train_on(
    config, a_gpu, monkeypatch, overrides, world_size, expected
):
    """torchrun's WORLD_SIZE or Ray's trainer ranks, the GPU's size as CUDA reports it, colocated as the
    config says, and the trainer offloaded when colocated and synchronous; the `tirl plan` command line
    carries each of them."""
    from tirl.rl.plan import GiB, preflight_cluster, preflight_command

    monkeypatch.setenv("WORLD_SIZE", world_size)
    cfg = _train_config(config, *overrides)
    cluster = preflight_cluster(cfg)
    assert (cluster.gpus, cluster.colocated, cluster.trainer_offload) == expected
    assert cluster.gpu_memory == a_gpu
    cmd = preflight_command(cluster, str(config), ["engine.max_model_len=512"], "train")
    shown = " ".join(cmd)
    assert f"--gpus {expected[0]} --gpu-memory {24 * GiB / GiB:.3f}" in shown
    assert ("--colocate" if expected[1] else "--separate") in cmd
    assert ("--trainer-offload" if expected[2] else "--no-trainer-offload") in cmd
    assert not {"--colocate", "--separate"} <= set(cmd) and not {
        "--trainer-offload",
        "--no-trainer-offload",
    } <= set(cmd)
    assert cmd[-1] == "engine.max_model_len=512"


def test_the_preflight_plan_runs_inside_a_torchrun_ranks_environment(config, a_gpu, monkeypatch):
    """Each torchrun rank runs the preflight with the rank's RANK, WORLD_SIZE, LOCAL_RANK and
    MASTER_PORT set: its `tirl plan` child (given none of them: the plan's fake process group must
    never meet the run's) still runs and gives its verdict. (Whether the child would notice them is not
    observable here: `tirl plan` on CPU reads none, see docs/mutation.md.)"""
    from tirl.ports import free_port
    from tirl.rl.plan import memory_preflight, preflight_env

    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"}
    for key, value in (torchrun | {"MASTER_PORT": str(free_port())}).items():
        monkeypatch.setenv(key, value)
    child = preflight_env()  # what the child is given: the rest of the environment, none of the rank's
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"} & set(child)
    assert len(child) == len(os.environ) - 4 and child["MASTER_ADDR"] == "127.0.0.1"
    assert all(os.environ[k] == v for k, v in child.items())
    cfg = _train_config(config, "optim.micro_batch_tokens=1024", "optim.device=cpu")
    lines = memory_preflight(cfg, str(config), ["optim.micro_batch_tokens=1024", "optim.device=cpu"], "train")
    assert len(lines) == 1 and lines[0].startswith("memory plan: FITS"), lines


def test_a_ray_runs_preflight_plans_its_trainer_ranks_not_the_drivers_one_process(config, monkeypatch):
    """The driver of a Ray run is one process (no WORLD_SIZE): its preflight plans the config's 64
    trainer ranks on separate GPUs. On (reported) 3 GiB GPUs that fits; one colocated GPU, which the
    driver's process alone would suggest, does not (a sleeping engine beside the trainer)."""
    from types import SimpleNamespace

    import torch

    from tirl.config import ConfigError
    from tirl.rl.plan import GiB, memory_preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=3 * GiB))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    small = ["optim.micro_batch_tokens=1024", "optim.device=cpu", "engine.gpu_memory_utilization=0.9"]
    ray = ["cluster.backend=ray", "cluster.trainer.ranks=64", *small]
    lines = memory_preflight(_train_config(config, *ray), str(config), ray, "train")
    assert len(lines) == 1 and lines[0].startswith("memory plan: FITS") and "of 3.0 GiB" in lines[0], lines
    with pytest.raises(ConfigError, match=r"DOES NOT FIT: training needs 3\.1 GiB per GPU of 3\.0"):
        memory_preflight(_train_config(config, *small), str(config), small, "train")


def test_the_preflight_reads_the_plans_verdict_not_whatever_it_printed_last():
    from subprocess import CompletedProcess

    from tirl.rl.plan import plan_verdict

    def verdict(stdout: str, stderr: str = "") -> str:
        return plan_verdict(CompletedProcess([], 0, stdout, stderr))

    assert verdict("cluster: 2 GPUs\nFITS: 3.1 GiB of 24.0\nadvice: none\n") == "FITS: 3.1 GiB of 24.0"
    assert verdict("DOES NOT FIT: 9 GiB of 8\nfix: engine.max_model_len=2048") == "DOES NOT FIT: 9 GiB of 8"
    assert verdict("FITS: an early line\nDOES NOT FIT: the last\ntail") == "DOES NOT FIT: the last"
    assert verdict("one\ntwo\nthree\n", "ignored") == "three"  # no verdict: the last line
    crash = "Traceback (most recent call last):\n" + "x" * 600 + "\nValueError: the reason\n"
    assert verdict("", crash) == crash.strip()[-500:] and len(verdict(" \n", crash)) == 500


def test_an_sft_runs_preflight_plans_its_ranks_with_no_engines(tiny_model_dir, tmp_path, a_gpu, monkeypatch):
    """`tirl sft` on GPUs: its config has no cluster and no engines, so the preflight plans
    torchrun's ranks on GPUs of their own with nothing to offload to, and the plan, run for real in its
    subprocess as `tirl plan --kind sft`, fits the tiny model."""
    from tirl.config import load_config
    from tirl.rl.config import SFTConfig
    from tirl.rl.plan import ClusterShape, memory_preflight, preflight_cluster, preflight_command

    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1"}]}) + "\n")
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump({"model": str(tiny_model_dir), "data": [str(data)], "max_length": 256}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(SFTConfig, config)
    assert preflight_cluster(cfg) == ClusterShape(2, a_gpu, False, False, "load")
    cmd = preflight_command(preflight_cluster(cfg), str(config), [], "sft")
    assert cmd[cmd.index("--kind") + 1] == "sft" and {"--separate", "--no-trainer-offload"} <= set(cmd)
    lines = memory_preflight(cfg, str(config), [], "sft")
    assert len(lines) == 1 and lines[0].startswith("memory plan: FITS") and "of 24.0 GiB" in lines[0], lines


def test_a_run_that_does_not_fit_its_gpus_stops_before_anything_starts(config, trainer_calls, monkeypatch):
    """On a (reported) 1 GiB GPU the plan, run for real in its subprocess, does not fit: `tirl train`
    stops with one error line holding the plan's verdict, before the trainer is called;
    TIRL_SKIP_PLAN=1 lets it start."""
    from types import SimpleNamespace

    import torch

    from tirl.rl.plan import GiB

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=GiB))
    small = ["optim.micro_batch_tokens=1024", "optim.device=cpu"]
    result = CliRunner().invoke(app, ["train", "--config", str(config), *small])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: memory plan: DOES NOT FIT: training needs ")
    assert "TIRL_SKIP_PLAN=1" in result.output and not trainer_calls
    monkeypatch.setenv("TIRL_SKIP_PLAN", "1")
    result = CliRunner().invoke(app, ["train", "--config", str(config), *small])
    assert result.exit_code == 0 and len(trainer_calls) == 1, result.output
