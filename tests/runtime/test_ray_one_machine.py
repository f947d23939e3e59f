"""The documented one-machine Ray command as a user runs it (docs/scaling.md): `tirl train ...
cluster.backend=ray cluster.trainer.ranks=2` with no cluster.address on this 2-core machine trains
with the default CPU settings (tirl's private Ray gets the logical CPUs the actors reserve), and a
placement no cluster can hold fails at once, in one line that names what to change."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from tests.terminal import run_tirl
from tests.train_config import write_train_config

pytest.importorskip("ray")


# LoRA on the Ray trainer workers: 2 steps (step 2 samples after the first sync of merged layers), an
# entropy bonus and a large learning rate so the adapter moves although an untrained model earns no reward
LORA = [
    "optim.lora.enabled=true", "optim.lora.rank=4", "optim.lora.alpha=16", "optim.lora.target_modules=q_proj,v_proj",
    "optim.lr=0.03", "optim.warmup_steps=0", "algorithm.entropy_coef=0.1", "stages.0.steps=2",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)  # Ray and five actors that import torch, on a loaded 2-core machine
@pytest.mark.parametrize("lora", [False, pytest.param(True, id="lora")])
def test_the_documented_one_machine_ray_command_trains_on_two_cores(tiny_model_dir, tmp_path, lora):
    assert (os.cpu_count() or 1) < 5  # the defaults reserve 5 logical CPUs: more than this machine has
    config = write_train_config(
        tmp_path,
        tiny_model_dir,
        engine={"backend": "hf", "device": "cpu", "max_model_len": 1024, "max_batch_size": 4},
    )
    overrides = LORA if lora else []
    done = run_tirl(
        "train",
        "--config",
        str(config),
        "cluster.backend=ray",
        "cluster.trainer.ranks=2",
        *overrides,
        timeout=840,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "step 1 " in done.stderr and f"run: {tmp_path / 'runs' / 'r'}" in done.stdout, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    if lora:
        check_lora_run(tmp_path / "runs" / "r", tiny_model_dir)


def check_lora_run(run_dir: Path, base_dir: Path) -> None:
    """The Ray trainer workers trained the adapters only: the checkpoint holds adapter/ (no model/) and
    shards with adapter weights and their AdamW state only; merged, the model differs from the base in the
    adapted layers only; and the engine sampled with the trainer's log-probs at every step."""
    from safetensors.torch import load_file

    from tirl.rl.checkpoint import export_model, latest_checkpoint, read_saved_training_state
    from tirl.rl.metrics import read_metrics

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    gaps = [r["train/engine_logprob_gap"] for r in rows]
    assert max(gaps) < 1e-4, gaps
    ckpt = latest_checkpoint(run_dir)
    assert (ckpt / "adapter" / "adapter_model.safetensors").is_file() and not (ckpt / "model").exists()
    saved = read_saved_training_state(ckpt)
    assert saved["model"] and all(".lora_" in k for k in saved["model"])
    optim = saved["optim"]["state"]
    assert optim and all(".lora_" in k for k in optim), list(optim)
    export_model(run_dir, run_dir.parent / "exported")
    merged = load_file(str(run_dir.parent / "exported" / "model.safetensors"))
    base = load_file(str(base_dir / "model.safetensors"))
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed), changed


def test_a_private_ray_too_small_for_the_actors_fails_before_starting(tiny_model_dir, tmp_path):
    config = write_train_config(
        tmp_path,
        tiny_model_dir,
        engine={"backend": "hf", "device": "cpu", "max_model_len": 1024, "max_batch_size": 4},
    )
    start = time.monotonic()
    done = run_tirl(
        "train",
        "--config",
        str(config),
        "cluster.backend=ray",
        "cluster.trainer.ranks=2",
        "cluster.num_cpus=2",
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cluster.num_cpus=2 is fewer logical CPUs"), lines
    assert "2 trainer ranks x cluster.trainer.num_cpus=1" in lines[0] and "= 5)" in lines[0]
    assert time.monotonic() - start < 120  # no Ray was started, no actor waited for


def test_an_impossible_placement_on_a_cluster_fails_at_once_naming_the_settings():
    """On a running cluster (here its node list, as ray.nodes() gives it) the total is checked before
    any placement group waits."""
    from tirl.runtime.config import ClusterConfig
    from tirl.runtime.ray_cluster import ClusterError, check_cluster_cpus

    class TwoCPUCluster:
        @staticmethod
        def nodes() -> list[dict]:
            return [{"Alive": True, "Resources": {"CPU": 2.0}}, {"Alive": False, "Resources": {"CPU": 64.0}}]

    cluster = ClusterConfig(backend="ray", address="auto", trainer={"ranks": 2})
    with pytest.raises(ClusterError) as raised:
        check_cluster_cpus(TwoCPUCluster, cluster, num_engines=1, trainer_ranks=2)
    message = str(raised.value)
    assert "\n" not in message and "reserve 5 logical CPUs" in message and "the Ray cluster has 2" in message
    assert "cluster.engines.num_cpus=1" in message and "cluster.reward_num_cpus=1" in message
    fits = cluster.model_copy(
        update={
            "engines": cluster.engines.model_copy(update={"num_cpus": 0.5}),
            "trainer": cluster.trainer.model_copy(update={"num_cpus": 0.25}),
            "sandbox": cluster.sandbox.model_copy(update={"num_cpus": 0.25}),
            "reward_num_cpus": 0.25,
        }
    )  # the settings the user found by hand: 1.5 logical CPUs
    check_cluster_cpus(TwoCPUCluster, fits, num_engines=1, trainer_ranks=2)


def test_a_private_ray_gets_the_logical_cpus_its_actors_reserve():
    from tirl.runtime.config import ClusterConfig

    cluster = ClusterConfig(backend="ray", trainer={"ranks": 2})
    assert cluster.logical_cpus(1, 2) == 5.0
    assert cluster.private_ray_cpus(1, 2) == max(5, os.cpu_count() or 1)
    assert ClusterConfig(backend="ray", num_cpus=3).private_ray_cpus(4, 2) == 3  # as given
