"""The RL trainer end to end on real parts (tiny model on the HF engine, real sandbox, math-verify):
multi-stage run, metrics, checkpoints, and an exact resume after SIGKILL mid-step."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tirl.config import ConfigError, load_config
from tirl.rl.config import TrainConfig
from tirl.rl.metrics import read_metrics
from tirl.rl.trainer import run_training

PROBLEMS = [
    ("p1", "What is 12 + 30?", "42"),
    ("p2", "What is 7 * 6?", "42"),
    ("p3", "What is 100 - 1?", "99"),
]
PROBLEMS += [("p4", "What is 2 ** 5?", "32"), ("p5", "What is 81 / 9?", "9")]
SRC = str(Path(__file__).parents[2] / "src")


def _write_config(tmp_path: Path, model_dir: Path, steps: tuple[int, int] = (2, 2)) -> Path:
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"id": i, "problem": q, "answer": a}) + "\n" for i, q, a in PROBLEMS))
    cfg = {
        "model": str(model_dir),
        "output_dir": str(tmp_path / "runs"),
        "seed": 7,
        "engine": {"backend": "hf", "device": "cpu", "max_model_len": 1024, "max_batch_size": 16},
        "agent": {"max_turns": 2, "max_response_tokens": 24},
        "sandbox": {"mode": "inprocess", "slots": 1},
        "reward": {"workers": 1},
        # All rewards are 0 for an untrained tiny model: the entropy bonus makes every update move the
        # weights, so later rollouts and losses depend on a correctly restored model and optimizer.
        "algorithm": {"prompts_per_step": 2, "group_size": 2, "mini_batches": 2, "entropy_coef": 0.1},
        "optim": {"lr": 1e-3, "warmup_steps": 1, "device": "cpu"},
        "stages": [
            {"name": "s1", "steps": steps[0], "data": str(data), "max_response_tokens": 20},
            {"name": "s2", "steps": steps[1], "data": str(data), "max_turns": 3},
        ],
        "checkpoint": {"every": 1, "keep_last": 2},
        "logging": {"tensorboard": False},
        "rollout_concurrency": 8,
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _comparable(rows: list[dict]) -> list[dict]:
    """Metrics that must replay exactly (everything but timings and throughput)."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/"))} for r in rows]


def _sampled(run_dir: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    return [
        (r["step"], r["problem_id"], r["sample_index"], r["response_text"], r["roc"]["kept"]) for r in rows
    ]


def test_kill_mid_step_then_resume_matches_uninterrupted_run(tiny_model_dir, tmp_path):
    config = _write_config(tmp_path, tiny_model_dir)
    ref_dir = run_training(load_config(TrainConfig, config, ["run_name=ref"]), progress=False)
    ref = read_metrics(ref_dir)
    assert [r["step"] for r in ref] == [1, 2, 3, 4] and [r["stage"] for r in ref] == [0, 0, 1, 1]
    assert ref[0]["train/entropy"] != ref[-1]["train/entropy"]  # the updates did change the policy
    for key in (
        "reward/mean",
        "tools/error_ratio_in_correct",
        "roc/kept",
        "train/clip_frac",
        "train/grad_norm",
    ):
        assert key in ref[-1]
    assert ref[0]["roc/kept"] == 4 and ref[0]["roc/dropped"] == 4  # 2 prompts x (2G = 4 -> G = 2)

    # The same run in a subprocess, SIGKILLed (with its sandbox and reward workers) during step 3.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "tirl.cli", "train", "--config", str(config), "--quiet", "run_name=killed"]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE)
    killed = tmp_path / "runs" / "killed"
    deadline = time.monotonic() + 240
    while not (killed / "checkpoints" / "step_000002").is_dir():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the killed run never reached step 2"
        time.sleep(0.05)
    time.sleep(0.3)  # step 3 is in flight
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert max(r["step"] for r in read_metrics(killed)) < 4

    resumed = run_training(load_config(TrainConfig, config, ["run_name=killed"]), resume=True, progress=False)
    rows = read_metrics(resumed)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["batch"] for r in rows] == [r["batch"] for r in ref]  # the same prompts, in order
    for got, want in zip(_comparable(rows), _comparable(ref), strict=True):
        assert got.keys() == want.keys()
        for k, v in want.items():
            if isinstance(v, float):
                assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (got["step"], k)
            else:
                assert got[k] == v, (got["step"], k)
    ckpts = sorted(p.name for p in (resumed / "checkpoints").iterdir())
    assert ckpts == ["step_000003", "step_000004"]  # keep_last=2, no temp dirs left behind
    # the trajectories sampled for `tirl view`: each step's once, the same ones as without the kill
    assert _sampled(resumed) == _sampled(ref_dir) and len(_sampled(ref_dir)) == 4 * 8

    with pytest.raises(ConfigError, match="already holds a run"):
        run_training(load_config(TrainConfig, config, ["run_name=killed"]), progress=False)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_engine_samples_from_the_weights_the_trainer_just_updated(tiny_model_dir, tmp_path):
    """After every update the trainer syncs its weights into the vLLM engine: the log-probs the engine
    sampled with match the trainer's own for the same tokens (a stale engine would drift away)."""
    config = _write_config(tmp_path, tiny_model_dir, steps=(2, 1))
    overrides = ["run_name=vllm", "engine.backend=vllm", "engine.kv_cache_gb=0.05", "optim.lr=1e-2"]
    rows = read_metrics(run_training(load_config(TrainConfig, config, overrides), progress=False))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["train/entropy"] != rows[-1]["train/entropy"]  # the policy did move
    gaps = [r["train/engine_logprob_gap"] for r in rows]
    assert max(gaps) < 1e-4, gaps


def test_config_errors_are_clear(tmp_path, tiny_model_dir):
    config = _write_config(tmp_path, tiny_model_dir)
    with pytest.raises(ConfigError, match=r"algorithm\.bogus"):
        load_config(TrainConfig, config, ["algorithm.bogus=1"])
    with pytest.raises(ConfigError, match="no checkpoint"):
        run_training(load_config(TrainConfig, config, ["run_name=none"]), resume=True, progress=False)
