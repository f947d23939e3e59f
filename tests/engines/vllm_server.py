"""The `vllm serve` command the remote-engine tests start their server with, and docs/engines.md shows."""

from __future__ import annotations

import sys
from pathlib import Path


def vllm_serve_command(
    model: str,
    port: int,
    host: str = "127.0.0.1",
    max_model_len: int = 4096,
    kv_cache_bytes: int | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The `vllm serve` command line (and environment) tirl expects of a server it talks to; on CPU give
    `kv_cache_bytes` (vLLM-CPU sizes its KV cache from it). docs/engines.md shows the same command
    (tests/test_readme.py checks it flag for flag)."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    argv += ["--host", host, "--port", str(port), "--max-model-len", str(max_model_len)]
    argv += ["--logprobs-mode", "processed_logprobs", "--enable-prefix-caching", "--seed", "0"]
    argv += ["--disable-uvicorn-access-log", "--served-model-name", Path(model).name]
    if kv_cache_bytes is not None:  # vLLM-CPU: exact KV budget, worker in the engine process, whole prefills
        argv += ["--kv-cache-memory-bytes", str(kv_cache_bytes), "--enforce-eager", "--dtype", "float32"]
        argv += ["--distributed-executor-backend", "uni", "--no-enable-chunked-prefill"]
        argv += ["--max-num-batched-tokens", str(max(8192, max_model_len))]
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    return argv, env
