"""`tirl plan`: measured training memory on fake tensors and a fake process group, engine KV cache
arithmetic on the real Qwen3-14B architecture, the verdict and its advice, and the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import tirl
from tirl.rl.plan import (
    ClusterShape,
    GiB,
    Workload,
    architecture_config,
    engine_memory,
    kv_bytes_per_token,
    make_plan,
    measure_training,
    micro_batch_shape,
    parameter_count,
)

RECIPE = Path(tirl.__file__).parent / "configs" / "rstar2"
ENGINE = dict(max_model_len=256, gpu_memory_utilization=0.5, tensor_parallel_size=1, dtype="bfloat16")


def test_qwen3_14b_from_its_published_sizes():
    """The architecture is built on the meta device from the published config: 14.77B parameters, 160 KiB
    of bf16 KV cache per token; an 80 GB GPU at 0.65 utilization keeps ~21 GB of KV cache."""
    config = architecture_config("Qwen/Qwen3-14B-Base")
    params = parameter_count(config)
    assert params == 14_768_307_200
    assert kv_bytes_per_token(config) == 2 * 40 * 8 * 128 * 2
    engine = engine_memory(
        config, params, 80 * GiB, ENGINE | {"max_model_len": 16384, "gpu_memory_utilization": 0.65}
    )
    assert engine.weights == params * 2
    assert 20 * GiB < engine.kv_cache < 23 * GiB and engine.trajectories == 8


def test_measured_14b_layers_shard_exactly_and_the_head_stays_small():
    """Two real Qwen3-14B decoder layers (full width, full vocabulary) at world size 8, one 16K-token
    micro-batch: rank 0 holds exactly 1/8 of the fp32 weights and twice that in AdamW moments, and the
    step's working memory stays below what the full-vocabulary fp32 logits alone would take."""
    config = architecture_config("qwen3-14b")
    config.num_hidden_layers = 2
    params = parameter_count(config)
    memory = measure_training(config, 8, Workload((1, 16384), bf16=True, gradient_checkpointing=True))
    assert memory.by_category["Sharded Param"] == pytest.approx(params * 4 / 8, rel=1e-3)
    assert memory.by_category["OptState"] == pytest.approx(params * 8 / 8, rel=1e-3)
    full_logits = 16384 * config.vocab_size * 4
    assert memory.by_category["Activation"] < full_logits


def _tiny_workload(tokens: int = 512) -> Workload:
    return Workload(micro_batch_shape(tokens, 256), True, True, ENGINE)


def test_a_tiny_plan_fits_and_a_starved_one_says_what_to_change(tiny_model_dir):
    config = architecture_config(str(tiny_model_dir))
    plan = make_plan(config, ClusterShape(2, 80 * GiB, colocated=True), _tiny_workload(), "tiny")
    assert plan.fits and plan.verdict().startswith("FITS")
    assert plan.training.peak > plan.training.by_category["Sharded Param"] > 0
    assert plan.sync_bytes == parameter_count(config) * 2  # bf16 to the engines, a tied head once
    starved = make_plan(config, ClusterShape(2, int(1.2 * GiB), colocated=True), _tiny_workload(), "tiny")
    assert not starved.fits
    assert "micro_batch_tokens" in starved.verdict() and "gpu_memory_utilization" in starved.verdict()


def test_the_plan_command_on_the_recipe(tiny_model_dir):
    """`tirl plan` reads the recipe with overrides, measures, prints the verdict; exit 1 when it does not fit."""
    from tirl.cli import app

    args = ["plan", "--config", str(RECIPE / "train.yaml"), "--arch", str(tiny_model_dir), "--gpus", "2"]
    small = ["engine.max_model_len=256", "optim.micro_batch_tokens=512"]
    result = CliRunner().invoke(app, [*args, *small])
    assert result.exit_code == 0, result.output
    assert "trajectories of 256 tokens" in result.output and "FITS" in result.output
    result = CliRunner().invoke(app, [*args, "--gpu-memory", "1", *small])
    assert result.exit_code == 1 and "DOES NOT FIT" in result.output


def test_no_preflight_without_a_gpu():
    from tirl.config import load_config
    from tirl.rl.config import SFTConfig
    from tirl.rl.plan import memory_preflight

    cfg = load_config(SFTConfig, RECIPE / "sft.yaml")
    assert memory_preflight(cfg, str(RECIPE / "sft.yaml"), [], "sft") == []
