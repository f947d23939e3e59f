"""The RL trainer end to end on real parts (tiny model on the HF engine, real sandbox, math-verify):
multi-stage run, metrics, checkpoints, and an exact resume after SIGKILLs at chosen points mid-stage."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from tests.logprobs import reference_logprobs
from tests.tied import run_to_the_end_or_fault

from tirl.config import ConfigError, load_config
from tirl.engines.base import SamplingParams
from tirl.rl.checkpoint import (
    latest_checkpoint,
    latest_model_dir,
    load_trainer_state,
    read_saved_training_state,
)
from tirl.rl.config import TrainConfig
from tirl.rl.metrics import read_metrics
from tirl.rl.trainer import FAULT_ENV, run_training

PROBLEMS = [
    ("p1", "What is 12 + 30?", "42"),
    ("p2", "What is 7 * 6?", "42"),
    ("p3", "What is 100 - 1?", "99"),
]
PROBLEMS += [("p4", "What is 2 ** 5?", "32"), ("p5", "What is 81 / 9?", "9")]
SRC = str(Path(__file__).parents[2] / "src")


def _write_config(tmp_path: Path, model_dir: Path, steps: tuple[int, int] = (3, 2)) -> Path:
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
        # A cosine schedule: the learning rate differs at every step, so a lost schedule shows (a
        # one-step warm-up would give its first two steps the same rate: 1/1, then the cosine's start).
        "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "cosine", "min_lr_ratio": 0.1, "device": "cpu"},
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


def train_in_subprocess(
    config: Path, name: str, overrides: Sequence[str] = (), resume: bool = False, fault: str | None = None
) -> Path:
    """`tirl train` in a fresh process, as a user runs it; with `fault` ("PHASE:STEP") the trainer's fault
    hook SIGKILLs it there. Runs compared bit for bit all train in fresh processes: a float reduction's
    last bits depend on process state (intra-op threads, backend flags) that earlier tests may change
    in the pytest process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    if fault:
        env[FAULT_ENV] = fault
    cmd = [sys.executable, "-m", "tirl.cli", "train", "--config", str(config), "--quiet", f"run_name={name}"]
    cmd += [*overrides, *(["--resume"] if resume else [])]
    run_to_the_end_or_fault(cmd, env, fault, timeout=900)
    return config.parent / "runs" / name


def _train_until_killed(
    config: Path, fault: str, resume: bool, overrides: Sequence[str] = (), name: str = "killed"
) -> None:
    train_in_subprocess(config, name, overrides, resume=resume, fault=fault)


def _final_state(run_dir: Path) -> tuple[dict, dict]:
    ckpt = latest_checkpoint(run_dir)
    # sharded checkpoints: the optimizer lives in the shards, gathered here for the comparison
    return load_file(ckpt / "model" / "model.safetensors"), {
        **load_trainer_state(ckpt),
        "optimizer": read_saved_training_state(ckpt)["optim"],
    }


@pytest.mark.slow
@pytest.mark.timeout(1500)  # five runs of the trainer (three of them killed); slow on a loaded machine
def test_kill_mid_stage_then_resume_matches_uninterrupted_run(tiny_model_dir, tmp_path):
    """SIGKILLed at chosen points inside a stage (and across its boundary), the resumed run draws the
    same batches and samples, and reaches the same losses, learning rates, weights, optimizer and RNG
    states as an uninterrupted run: so it restored the weights, optimizer, LR schedule, sampler
    position, step counters and RNG states, and dropped the metrics of the step it redid."""
    config = _write_config(tmp_path, tiny_model_dir)
    ref_dir = run_training(load_config(TrainConfig, config, ["run_name=ref"]), progress=False)
    ref = read_metrics(ref_dir)
    assert [r["step"] for r in ref] == [1, 2, 3, 4, 5] and [r["stage"] for r in ref] == [0, 0, 0, 1, 1]
    assert ref[0]["roc/kept"] == 4 and ref[0]["roc/dropped"] == 4  # 2 prompts x (2G = 4 -> G = 2)
    lrs = [r["train/lr"] for r in ref]
    assert len(set(lrs[:3])) == 3 and lrs[3] != lrs[2]  # cosine within a stage, restarting at s2
    assert len({r["train/entropy"] for r in ref}) == 5  # every update changed the policy

    killed = tmp_path / "runs" / "killed"
    # (a kill after a step's update may leave its staged checkpoint, hidden; the resumed run removes it)
    ckpts = lambda: [p.name for p in sorted((killed / "checkpoints").iterdir()) if p.name[0] != "."]  # noqa: E731
    # during step 2's rollout: resumes from step 1, inside stage s1
    _train_until_killed(config, "rollout:2", resume=False)
    assert ckpts() == ["step_000001"] and [r["step"] for r in read_metrics(killed)] == [1]
    first_rng = load_trainer_state(killed / "checkpoints" / "step_000001")["rng"]
    # after step 3's update, before its checkpoint: resumes from step 2, inside stage s1
    _train_until_killed(config, "update:3", resume=True)
    assert ckpts() == ["step_000001", "step_000002"] and [r["step"] for r in read_metrics(killed)] == [1, 2]
    # step 4 (the first of stage s2) logged, not checkpointed: the resumed run redoes and re-logs it
    _train_until_killed(config, "logged:4", resume=True)
    assert ckpts() == ["step_000002", "step_000003"] and [r["step"] for r in read_metrics(killed)] == [
        1,
        2,
        3,
        4,
    ]

    resumed = run_training(load_config(TrainConfig, config, ["run_name=killed"]), resume=True, progress=False)
    rows = read_metrics(resumed)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["batch"] for r in rows] == [r["batch"] for r in ref]  # the same prompts, in order
    for got, want in zip(_comparable(rows), _comparable(ref), strict=True):
        assert got.keys() == want.keys()
        for k, v in want.items():
            if isinstance(v, float):
                assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (got["step"], k)
            else:
                assert got[k] == v, (got["step"], k)
    (weights, state), (ref_weights, ref_state) = _final_state(resumed), _final_state(ref_dir)
    assert weights.keys() == ref_weights.keys()
    for name, w in ref_weights.items():
        torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6, msg=name)
    assert state["scheduler"] == ref_state["scheduler"] and state["sampler"] == ref_state["sampler"]
    for got, want in zip(
        state["optimizer"]["state"].values(), ref_state["optimizer"]["state"].values(), strict=True
    ):
        assert got["step"] == want["step"]
        torch.testing.assert_close(got["exp_avg_sq"], want["exp_avg_sq"], rtol=1e-4, atol=1e-10)
    # Global RNG states: the first process's (seeded from OS entropy) carried through every resume,
    # since nothing in training draws from them. (Python's `random` is left out: libraries draw from it.)
    assert all(np.array_equal(a, b) for a, b in zip(state["rng"]["numpy"], first_rng["numpy"], strict=True))
    assert torch.equal(state["rng"]["torch"], first_rng["torch"])
    assert ckpts() == ["step_000004", "step_000005"]  # keep_last=2
    assert not list((killed / "checkpoints").glob(".*"))  # no staged or temp dirs left behind
    # the trajectories sampled for `tirl view`: each step's once, the same ones as without the kills
    assert _sampled(resumed) == _sampled(ref_dir) and len(_sampled(ref_dir)) == 5 * 8

    with pytest.raises(ConfigError, match="already holds a run"):
        run_training(load_config(TrainConfig, config, ["run_name=killed"]), progress=False)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
async def test_vllm_engine_samples_from_the_weights_the_trainer_just_updated(tiny_model_dir, tmp_path):
    """As tirl demo trains (the default demo's vLLM engines, on a runtime it opened for its SFT
    evaluation): after every update the trainer syncs its weights into the engine, so the log-probs
    the engine sampled with match the trainer's own for the same tokens (a stale engine would drift
    away); after the run the engine serves exactly the final checkpoint (what the demo evaluates on)."""
    from transformers import AutoModelForCausalLM

    from tirl.rl.trainer import train_on
    from tirl.runtime import open_runtime

    config = _write_config(tmp_path, tiny_model_dir, steps=(2, 1))
    overrides = ["run_name=vllm", "engine.backend=vllm", "engine.kv_cache_gb=0.05", "optim.lr=1e-2"]
    cfg = load_config(TrainConfig, config, overrides)
    # Longer than a KV block, so a prefix cache kept across the syncs would serve it from old weights.
    prompt, params = list(range(5, 45)), SamplingParams(temperature=1.0, max_tokens=16, seed=3)
    async with open_runtime(cfg.cluster, cfg.engine, cfg.sandbox, cfg.reward) as rt:
        before = await rt.engines[0].generate(prompt, params)  # and old-weight KV in the prefix cache
        run_dir = await train_on(rt, cfg, progress=False)
        after = await rt.engines[0].generate(prompt, params)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["train/entropy"] != rows[-1]["train/entropy"]  # the policy did move
    gaps = [r["train/engine_logprob_gap"] for r in rows]
    assert max(gaps) < 1e-4, gaps
    final = AutoModelForCausalLM.from_pretrained(latest_model_dir(run_dir), dtype=torch.float32)
    torch.testing.assert_close(
        torch.tensor(after.logprobs), reference_logprobs(final, prompt, after.token_ids), atol=1e-4, rtol=0
    )
    stale = reference_logprobs(final, prompt, before.token_ids) - torch.tensor(before.logprobs)
    assert stale.abs().max() > 1e-3  # the start's weights are not the final ones


async def test_train_on_a_callers_runtime_leaves_it_open_on_the_last_steps_weights(tiny_model_dir, tmp_path):
    """tirl demo evaluates before and after RL on the runtime the run trained on: train_on leaves it
    open, its engines holding exactly the final checkpoint's weights (synced after the last step)."""
    from tirl.rl.trainer import train_on
    from tirl.runtime import open_runtime

    config = _write_config(tmp_path, tiny_model_dir, steps=(2, 1))
    cfg = load_config(TrainConfig, config, ["run_name=on", "optim.lr=1e-2"])
    engine = cfg.engine.model_copy(update={"model": str(tiny_model_dir)})
    async with open_runtime(cfg.cluster, engine, cfg.sandbox, cfg.reward) as rt:
        run_dir = await train_on(rt, cfg, progress=False)
        held = {k: v.detach().clone() for k, v in rt.engines[0].model.state_dict().items()}
        generated = await rt.engines[0].generate([5, 6, 7], SamplingParams(max_tokens=4, seed=0))
    assert len(generated.token_ids) == 4  # still serving after the run
    saved = load_file(latest_checkpoint(run_dir) / "model" / "model.safetensors")
    start = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert any(not torch.equal(saved[k], start[k]) for k in saved)  # the policy did move
    for k, v in saved.items():
        assert torch.equal(held[k], v), k
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]


def test_config_errors_are_clear(tmp_path, tiny_model_dir):
    config = _write_config(tmp_path, tiny_model_dir)
    with pytest.raises(ConfigError, match=r"algorithm\.bogus"):
        load_config(TrainConfig, config, ["algorithm.bogus=1"])
    with pytest.raises(ConfigError, match="no checkpoint"):
        run_training(load_config(TrainConfig, config, ["run_name=none"]), resume=True, progress=False)
