"""Tensor parallelism > 1 (issue 41, item 6), placed on CPU: vLLM cannot run on the occasional GPU this
project is lent, so what a two-GPU engine is given is checked here, not its run (docs/scaling.md).

Under torchrun engine i takes GPUs [i*tp, (i+1)*tp) (CUDA_VISIBLE_DEVICES for its workers); on Ray an
engine actor holds its tp GPUs in one bundle; either way vLLM runs them with its multiprocessing
executor (its Ray executor wants a bundle per GPU and refuses the actor's)."""

from __future__ import annotations

import pytest
import torch

from tirl.config import load_config
from tirl.engines import factory
from tirl.engines.config import EngineConfig
from tirl.engines.vllm import VLLMEngine, engine_args, visible_gpus
from tirl.rl.config import TrainConfig
from tirl.runtime.config import ClusterConfig

TWO = EngineConfig(backend="vllm", model="m", num_engines=2, tensor_parallel_size=2)


def test_a_two_gpu_engine_runs_on_vllms_multiprocessing_executor():
    args = engine_args(TWO, on_cpu=False, sleep=False, worker_extension="x.Y")
    assert args["tensor_parallel_size"] == 2 and args["distributed_executor_backend"] == "mp"
    one = engine_args(TWO.model_copy(update={"tensor_parallel_size": 1}), False, False, "x.Y")
    assert "distributed_executor_backend" not in one and "tensor_parallel_size" not in one


def test_under_torchrun_engine_i_takes_consecutive_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    devices = [factory._engine_device(TWO, i).device for i in range(2)]
    assert devices == ["cuda:0", "cuda:2"]
    assert [visible_gpus(d, 2) for d in devices] == ["0,1", "2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the launcher narrowed them: ours are among them
    assert visible_gpus("cuda:2", 2) == "6,7"
    with pytest.raises(ValueError, match=r"needs GPUs \[3, 4\], but CUDA_VISIBLE_DEVICES='4,5,6,7' shows 4"):
        visible_gpus("cuda:3", 2)
    three = TWO.model_copy(update={"num_engines": 3})
    with pytest.raises(
        ValueError, match=r"engine\.num_engines=3 x engine\.tensor_parallel_size=2 needs 6 GPUs"
    ):
        factory._engine_device(three, 0)


def test_a_two_gpu_engine_opens_ipc_buffers_on_either_of_its_gpus_by_its_own_numbering():
    engine = object.__new__(VLLMEngine)  # the placement only: no vLLM is started
    engine.cfg, engine.on_cpu = TWO.model_copy(update={"device": "cuda:2"}), False
    assert engine.gpus == [2, 3]
    assert engine.near(torch.device("cuda", 3)) and not engine.near(torch.device("cuda", 0))
    assert engine.gpus.index(3) == 1  # the index its workers open a buffer on cuda:3 with


def test_on_ray_a_two_gpu_engine_is_one_actor_holding_both_gpus(tmp_path):
    cluster = ClusterConfig(backend="ray", engines={"num_gpus": 2})
    assert cluster.engines.as_bundle()["GPU"] == 2  # one bundle, both GPUs: the actor's own
    base = ["model=m", "stages=[{steps: 1, data: x}]", "engine.backend=vllm", "engine.tensor_parallel_size=2"]
    load_config(TrainConfig, None, [*base, "cluster.backend=ray", "cluster.engines.num_gpus=2"])
    with pytest.raises(ValueError, match=r"cluster\.engines\.num_gpus=1 gives each engine actor that many"):
        load_config(TrainConfig, None, [*base, "cluster.backend=ray", "cluster.engines.num_gpus=1"])
