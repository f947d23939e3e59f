"""The `cluster` section: validated like the rest, one clear line when something cannot work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tirl.config import ConfigError, load_config
from tirl.rl.config import TrainConfig

SRC = str(Path(__file__).parents[2] / "src")


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"model": "m", "stages": [{"steps": 1, "data": "d.jsonl"}]}))
    return path


def test_local_is_the_default_and_ray_only_fields_are_refused_under_it(tmp_path):
    cfg = load_config(TrainConfig, _config(tmp_path))
    assert cfg.cluster.backend == "local"
    with pytest.raises(ConfigError, match=r"cluster\.address is for backend=ray"):
        load_config(TrainConfig, _config(tmp_path), ["cluster.address=auto"])
    with pytest.raises(ConfigError, match="torchrun"):
        load_config(TrainConfig, _config(tmp_path), ["cluster.trainer.ranks=2"])
    with pytest.raises(ConfigError, match=r"cluster\.engines\.num_gpu"):
        load_config(TrainConfig, _config(tmp_path), ["cluster.engines.num_gpu=1"])
    with pytest.raises(ConfigError, match=r"cluster\.backend"):
        load_config(TrainConfig, _config(tmp_path), ["cluster.backend=slurm"])


def test_ray_config_carries_placement(tmp_path):
    pytest.importorskip("ray")  # make test installs tirl[ray]; this checks the parsing only
    cfg = load_config(
        TrainConfig,
        _config(tmp_path),
        ["cluster.backend=ray", "cluster.trainer.ranks=2", "cluster.engines.resources={engine_node: 1}"],
    )
    assert cfg.cluster.trainer.ranks == 2
    assert cfg.cluster.engines.as_bundle() == {"CPU": 1.0, "engine_node": 1.0}


def test_missing_ray_is_one_clear_line(tmp_path):
    """`tirl train` with cluster.backend=ray where Ray cannot be imported: exit 2, how to install it."""
    code = "import sys; sys.modules['ray'] = None; sys.argv[0] = 'tirl'; from tirl.cli import app; app()"
    proc = subprocess.run(
        [sys.executable, "-c", code, "train", "--config", str(_config(tmp_path)), "cluster.backend=ray"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'tirl[ray]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_paper_cluster_layout_loads_and_adds_up():
    """configs/rstar2/cluster_64gpu.yaml with the recipe: 64 engines colocated with 64 ranks, one bundle
    of 1 GPU per pair = 8 x 8 GPUs."""
    pytest.importorskip("ray")
    rstar2 = Path(__file__).parents[2] / "src/tirl/configs/rstar2"
    cfg = load_config(
        TrainConfig,
        rstar2 / "train.yaml",
        [f"cluster={rstar2 / 'cluster_64gpu.yaml'}", "engine.num_engines=64"],
    )
    c = cfg.cluster
    assert c.backend == "ray" and c.sandbox.resource == "sandbox_node"
    assert c.colocate and cfg.engine.enable_sleep_mode
    assert cfg.engine.num_engines == c.trainer.ranks and c.trainer.ranks * c.trainer.num_gpus == 64


def test_colocate_is_validated(tmp_path):
    """cluster.colocate: engine i and trainer rank i share one bundle, so they must ask for the same
    devices, one engine per rank, and vLLM on GPUs must be able to sleep."""
    pytest.importorskip("ray")
    ray = ["cluster.backend=ray", "cluster.colocate=true", "cluster.trainer.ranks=2", "engine.num_engines=2"]
    cfg = load_config(TrainConfig, _config(tmp_path), ray)
    assert cfg.cluster.colocated
    assert not load_config(TrainConfig, _config(tmp_path), ray[:1]).cluster.colocated
    assert load_config(TrainConfig, _config(tmp_path)).cluster.colocated  # local: engine i on cuda:i
    bad = {
        "cluster.colocate is for backend=ray": ["cluster.colocate=true"],
        "engine.num_engines=1 and cluster.trainer.ranks=2": [*ray, "engine.num_engines=1"],
        r"cluster\.engines\.num_gpus=1 differs from cluster\.trainer\.num_gpus=0": [
            *ray,
            "cluster.engines.num_gpus=1",
        ],
        "num_gpus=2, but a colocated engine and rank share one GPU": [
            *ray,
            "cluster.engines.num_gpus=2",
            "cluster.trainer.num_gpus=2",
        ],
        r"cluster\.engines\.resources=\{'gpu_node': 1\.0\} and cluster\.trainer\.resources=\{\} differ": [
            *ray,
            "cluster.engines.resources={gpu_node: 1}",
        ],
        "set engine.enable_sleep_mode=true": [
            *ray,
            "engine.backend=vllm",
            "cluster.engines.num_gpus=1",
            "cluster.trainer.num_gpus=1",
        ],
    }
    for message, overrides in bad.items():
        with pytest.raises(ConfigError, match=message):
            load_config(TrainConfig, _config(tmp_path), overrides)


def test_local_vllm_engines_on_the_trainers_gpus_must_sleep(tmp_path):
    """Issue 68, fix 7: backend=local puts engine i on cuda:i next to torchrun rank i, so vLLM engines on
    GPUs that cannot sleep keep gpu_memory_utilization of the memory the rank trains in: refused as on
    Ray. On a CPU, with sleep mode, or with async engines (they never lend) it is allowed."""
    vllm = ["engine.backend=vllm", "engine.device=cuda"]
    with pytest.raises(ConfigError, match=r"cluster\.backend=local .*set engine\.enable_sleep_mode=true"):
        load_config(TrainConfig, _config(tmp_path), vllm)
    assert load_config(TrainConfig, _config(tmp_path), [*vllm, "engine.enable_sleep_mode=true"])
    assert load_config(TrainConfig, _config(tmp_path), ["engine.backend=vllm", "engine.device=cpu"])
