"""How to build inference engines (backend, model, capacity) from a config."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tirl.config import ENGINE_API_KEY_ENV, secret_or_env

ApiKey = secret_or_env(ENGINE_API_KEY_ENV)


class RemoteServers(BaseModel):
    """engine.backend=remote: inference servers started elsewhere (`vllm serve`, SGLang), one engine per URL."""

    model_config = ConfigDict(extra="forbid")

    urls: list[str] = Field(default_factory=list)  # e.g. ["http://10.0.0.5:8000"]
    api: Literal["vllm", "sglang"] = "vllm"  # which server speaks at the URLs
    served_model: str = ""  # the name the server serves the model under ("": ask its /v1/models)
    api_key: ApiKey = None  # sent as a Bearer token; env:NAME, file:PATH; null: $TIRL_ENGINE_API_KEY
    weights_dir: str = ""  # storage both sides see: load_weights writes there, the servers reload it
    start_timeout_s: float = Field(600.0, gt=0)  # wait this long for every server to answer /health
    request_timeout_s: float = Field(3600.0, gt=0)  # one turn's generation
    poll_s: float = Field(1.0, gt=0)  # KV usage and health polled this often
    down_cooldown_s: float = Field(5.0, ge=0)  # a failed server is probed again after this


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backend: Literal["hf", "vllm", "remote", "sglang"] = "hf"  # remote: servers at engine.remote.urls
    model: str = ""  # local path (or hub id for users with internet)
    num_engines: int = 1  # > 1: trajectories are spread by tirl.engines.scheduler
    scheduler: Literal["dynamic", "static"] = "dynamic"  # dynamic = KV-cache-aware (the paper)
    # Share of the max trajectory length L a fresh trajectory reserves in an engine's free KV (its
    # reservation then follows its real context). 1.0 = the full L: never a preemption, but engines
    # hold only free KV // L trajectories. Lower admits more: 0.7 had no preemptions and ran up to
    # ~20% faster than 1.0 on heavy-tailed simulated loads (benchmarks/scheduler_sim.py), but can
    # preempt when many trajectories run to L together.
    scheduler_reserve: float = Field(1.0, gt=0.0, le=1.0)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16 | float16
    max_model_len: int = 4096
    max_batch_size: int = 64  # hf: sequences decoded together
    gpu_memory_utilization: float = 0.5  # vllm on CUDA
    kv_cache_gb: float = 1.0  # vllm on CPU (VLLM_CPU_KVCACHE_SPACE)
    tensor_parallel_size: int = Field(1, ge=1)  # vllm on CUDA: GPUs per engine (a 32B model in bf16)
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = False  # vllm colocated with the trainer: free memory while training
    seed: int = 0
    # Each request sampled with its own seed (reproducible trajectories, exact resume). vLLM on a GPU
    # samples seeded requests one at a time (a generator each): at hundreds of requests in flight,
    # false (the engine's seed only) is the faster choice.
    request_seeds: bool = True
    remote: RemoteServers = Field(default_factory=RemoteServers)
