"""The vLLM surface tirl calls, checked against the installed vLLM without starting an engine: the
version inside the pinned range (pyproject.toml) and every signature the engine and the weight sync
use, so a vLLM release that moves them fails here rather than on a GPU node."""

from __future__ import annotations

import importlib.util
import inspect
import re
import tomllib
from pathlib import Path

import pytest

from tirl.engines.config import EngineConfig

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_installed_vllm_is_inside_the_pinned_range():
    import vllm
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    [pin] = extras["vllm"]
    spec = SpecifierSet(re.sub(r"^vllm", "", pin))
    assert spec.contains(Version("0.32.0")) and not spec.contains(Version("1.0")), "a tested range, bounded"
    assert Version(vllm.__version__).base_version in spec


@pytest.mark.parametrize("on_cpu", [True, False])
def test_engine_arguments_are_vllm_engine_arguments(on_cpu):
    from vllm.engine.arg_utils import AsyncEngineArgs

    from tirl.engines.vllm import engine_args

    cfg = EngineConfig(backend="vllm", model="/models/qwen3-32b", tensor_parallel_size=2, dtype="bfloat16")
    kwargs = engine_args(
        cfg, on_cpu=on_cpu, sleep=not on_cpu, worker_extension="tirl.runtime.ray.SyncWorkerExtension"
    )
    args = AsyncEngineArgs(**kwargs)  # unknown keywords raise TypeError
    assert args.dtype == "bfloat16" and args.worker_extension_cls.endswith("SyncWorkerExtension")
    assert args.tensor_parallel_size == (1 if on_cpu else 2)  # tensor parallelism is a GPU matter
    assert args.enable_sleep_mode is (not on_cpu)


def test_the_calls_tirl_makes_exist_with_these_signatures():
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert {"method", "args", "timeout"} <= _params(AsyncLLM.collective_rpc)
    assert "reset_running_requests" in _params(AsyncLLM.reset_prefix_cache)
    assert "level" in _params(AsyncLLM.sleep) and "tags" in _params(AsyncLLM.wake_up)
    assert {"weights_iterator", "is_checkpoint_format"} <= _params(GPUModelRunner.reload_weights)
    assert callable(initialize_layerwise_reload) and callable(finalize_layerwise_reload)


def test_worker_extension_names_do_not_clash_with_the_worker():
    """vLLM refuses an extension whose attributes the worker class already has."""
    from vllm.v1.worker.gpu_worker import Worker

    from tirl.runtime.ray import SyncWorkerExtension

    ours = {a for a in dir(SyncWorkerExtension) if not a.startswith("__")}
    assert ours and not ours & set(dir(Worker))
    assert {
        "tirl_reload",
        "tirl_load_flat",
        "tirl_load_ipc",
        "tirl_join",
        "tirl_receive",
        "tirl_leave",
    } <= ours
