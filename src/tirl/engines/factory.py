"""Build engines and an engine pool from an EngineConfig."""

from __future__ import annotations

from tirl.engines.base import Engine, EnginePool, SingleEnginePool
from tirl.engines.config import EngineConfig


def build_engines(cfg: EngineConfig, model=None) -> list[Engine]:
    """cfg.num_engines engines of cfg.backend; `model` (hf only) is a live torch model to serve in-process."""
    if cfg.num_engines < 1:
        raise ValueError(f"engine.num_engines must be >= 1, got {cfg.num_engines}")
    if cfg.backend == "hf":
        from tirl.engines.hf import HFEngine

        if model is not None and cfg.num_engines > 1:
            raise ValueError("one live model can back only one hf engine: set engine.num_engines=1")
        return [HFEngine(cfg, name=f"hf{i}", model=model) for i in range(cfg.num_engines)]
    if cfg.backend == "vllm":
        if model is not None:
            raise ValueError("the vllm backend loads weights from engine.model; pass model=None")
        from tirl.engines.vllm import VLLMEngine  # imports vllm lazily: VLLMEngine says how to install it

        return [VLLMEngine(_engine_device(cfg, i), name=f"vllm{i}") for i in range(cfg.num_engines)]
    if cfg.backend == "remote":
        if model is not None:
            raise ValueError("the remote backend serves the servers' own weights; pass model=None")
        from tirl.engines.remote import build_server_engines

        return list(build_server_engines(cfg))
    if cfg.backend == "sglang":
        if model is not None:
            raise ValueError("the sglang backend loads weights from engine.model; pass model=None")
        from tirl.engines.sglang import SGLangEngine  # imports sglang lazily: it says how to install it

        return [SGLangEngine(cfg, f"sglang{i}", _gpu_of(cfg, i)) for i in range(cfg.num_engines)]
    raise ValueError(f"unknown engine.backend {cfg.backend!r}: use hf, vllm, remote or sglang")


def build_pool(engines: list[Engine], cfg: EngineConfig) -> EnginePool:
    """One engine: every trajectory runs on it. Several: the KV-cache-aware rollout scheduler spreads them."""
    if not engines:
        raise ValueError("build_pool needs at least one engine")
    if len(engines) == 1:
        return SingleEnginePool(engines[0])
    from tirl.engines.scheduler import RolloutScheduler

    return RolloutScheduler(engines, mode=cfg.scheduler, reserve=cfg.scheduler_reserve)


def _engine_device(cfg: EngineConfig, index: int) -> EngineConfig:
    """Several vLLM engines on a multi-GPU node: engine i gets its own GPUs, [i*tp, (i+1)*tp) with
    tensor parallelism tp (consecutive: its workers talk over the node's links), instead of all sharing
    the first ones."""
    import torch

    count, tp = torch.cuda.device_count(), cfg.tensor_parallel_size
    if cfg.device in ("auto", "cuda") and cfg.num_engines > 1 and count > 1:
        if tp > 1 and cfg.num_engines * tp > count:  # (single-GPU engines may share GPUs round-robin)
            raise ValueError(
                f"engine.num_engines={cfg.num_engines} x engine.tensor_parallel_size={tp} needs "
                f"{cfg.num_engines * tp} GPUs, this node shows {count}"
            )
        return cfg.model_copy(update={"device": f"cuda:{(index * tp) % count}"})
    return cfg


def _gpu_of(cfg: EngineConfig, index: int) -> str | None:
    """The GPU an SGLang server of engine `index` sees alone (None: all of them, e.g. tensor parallel)."""
    device = _engine_device(cfg, index).device if cfg.tensor_parallel_size == 1 else cfg.device
    return device.split(":", 1)[1] if device.startswith("cuda:") else None
