"""torchrun with 2 FSDP ranks and a vLLM-CPU engine on rank 0 (the `local` runtime): every sync goes
through the flat shared-memory buffer into one in-place reload, and the engine's log-probs stay those
of the trainer's policy step after step (a corrupted sync shows as a large or NaN gap)."""

from __future__ import annotations

import importlib.util

import pytest
from tests.terminal import run_tirl
from tests.tied import torchrun
from tests.train_config import write_train_config

from tirl.ports import free_port
from tirl.rl.metrics import read_metrics

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]


@pytest.mark.timeout(900)
def test_torchrun_two_ranks_with_a_vllm_cpu_engine_keeps_engine_and_trainer_in_step(tiny_model_dir, tmp_path):
    config = write_train_config(
        tmp_path,
        tiny_model_dir,
        steps=2,
        seed=3,
        engine={"backend": "vllm", "max_model_len": 1024, "kv_cache_gb": 0.02},
        agent={"max_turns": 1, "max_response_tokens": 16},
        algorithm={"prompts_per_step": 2, "group_size": 2, "mini_batches": 1, "entropy_coef": 0.1},
        optim={"device": "cpu", "lr": 1e-3, "warmup_steps": 0},
        checkpoint={"every": 2},
    )
    launcher = torchrun("--nproc_per_node=2", f"--master_port={free_port()}")
    done = run_tirl("train", "--config", str(config), launcher=launcher, timeout=850)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = read_metrics(tmp_path / "runs" / "r")
    assert [g["step"] for g in got] == [1, 2]
    for g in got:  # step 2 samples from the weights step 1's sync loaded
        assert g["train/engine_logprob_gap"] < 1e-3, g["train/engine_logprob_gap"]
