"""engine.backend=sglang: SGLang engines that tirl starts and owns, one SGLang server process each.

Each engine is `python -m sglang.launch_server` on a loopback port (its GPU pinned through
CUDA_VISIBLE_DEVICES) with a random API key only this process holds, driven through SGLang's native
API by the same client as engine.backend=remote (tirl.engines.remote, api=sglang): token ids in
(`input_ids`), token ids and log-probs out (`output_token_logprobs`), free KV from /v1/loads for the
KV-aware scheduler, weights reloaded in place (/update_weights_from_disk, from a safetensors file tirl
writes to /dev/shm), the radix (prefix) cache flushed after every reload (/flush_cache), sleep/wake
through SGLang's memory saver (/release_memory_occupation, /resume_memory_occupation; start with
engine.enable_sleep_mode).

A server process rather than SGLang's in-process `sgl.Engine`: that one binds itself to the event loop
that created it and runs its sync methods with `run_until_complete` on it, which cannot serve callers
on other loops (pytest's, the trainer's) the way tirl's engines must; the server has no such tie, and
it dies with this process (tirl.lifetime).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch

from tirl.devices import resolve_device
from tirl.engines.base import Generation, KVCapacity, SamplingParams
from tirl.engines.config import EngineConfig, RemoteServers
from tirl.engines.remote import ServerEngine, ServerExited
from tirl.lifetime import stop_child
from tirl.ports import free_port

INSTALL_HINT = (
    "the sglang backend needs SGLang: `pip install 'tirl[sglang]'` (CUDA GPUs; it pins its own torch, so "
    "use a separate environment from vLLM's), or serve SGLang elsewhere and use engine.backend=remote "
    "with engine.remote.api=sglang"
)


PYTHON_ENV = "TIRL_SGLANG_PYTHON"  # an interpreter of another environment that has SGLang
API_KEY_ENV = "TIRL_SGLANG_API_KEY"  # the server's key, handed over in its environment only
PARENT_ENV = "TIRL_SGLANG_PARENT"  # tirl's pid: the server dies with it
START_TRIES = 3  # server starts, each on a new port, before one that exits while starting is an error

# `python -m sglang.launch_server ... --api-key KEY`, with KEY taken from the environment: an argument
# is readable by every user of the machine (/proc/PID/cmdline, `ps`), the environment only by its
# owner. Popped, so SGLang's own workers do not inherit it. Joined as `--api-key=KEY`: a url-safe key
# starts with '-' one time in 64, and argparse reads a separate '-...' value as a flag.
# The server also tells the kernel to kill it when tirl dies (even by SIGKILL), itself, after exec:
# Python code between fork and exec (a preexec_fn) can deadlock in a parent with threads, as tirl's are;
# and the server's Python may lack tirl (tirl.lifetime.die_with_parent), so the prctl is spelt here.
LAUNCH = (
    "import ctypes, os, runpy, signal, sys; "
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0); "  # 1: PR_SET_PDEATHSIG
    f"os.getppid() == int(os.environ.pop({PARENT_ENV!r})) or sys.exit(1); "  # tirl died before the prctl
    f"sys.argv.append('--api-key=' + os.environ.pop({API_KEY_ENV!r})); "
    "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)"
)


def sglang_python() -> str:
    """The Python that runs the SGLang servers: $TIRL_SGLANG_PYTHON (SGLang pins its own torch, so it
    may live in an environment of its own; tirl talks to it over HTTP only), else this one."""
    return os.environ.get(PYTHON_ENV) or sys.executable


def require_sglang() -> None:
    """Fail early with an actionable message when the server's Python has no SGLang."""
    python = sglang_python()
    probe = subprocess.run(
        [python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"],
        capture_output=True,
    )
    if probe.returncode != 0:
        raise ImportError(f"{INSTALL_HINT} (no SGLang in {python}; ${PYTHON_ENV} names another Python)")


def sglang_server_command(cfg: EngineConfig, port: int) -> list[str]:
    """The SGLang server command for one engine of `cfg` (dtype, context, memory, seed, caching, sleep).
    It requires the API key in $TIRL_SGLANG_API_KEY (`server_env`), never on its command line."""
    argv = [sglang_python(), "-c", LAUNCH, "--model-path", cfg.model]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--context-length", str(cfg.max_model_len)]
    argv += ["--random-seed", str(cfg.seed), "--log-level", "warning", "--skip-server-warmup"]
    if cfg.dtype != "auto":
        argv += ["--dtype", cfg.dtype]
    if resolve_device(cfg.device).type == "cpu":  # "auto" without a GPU too
        argv += ["--device", "cpu"]
    else:
        argv += ["--mem-fraction-static", str(cfg.gpu_memory_utilization)]
    if cfg.tensor_parallel_size > 1:
        argv += ["--tp-size", str(cfg.tensor_parallel_size)]
    if not cfg.enable_prefix_caching:
        argv += ["--disable-radix-cache"]
    if cfg.enable_sleep_mode:
        argv += ["--enable-memory-saver"]
    return argv


def server_env(api_key: str, gpu: str | None, device: str) -> dict[str, str]:
    """The server's environment: this one, its key, its GPU, and SGLang's CPU engine on a CPU."""
    env = dict(os.environ) | {API_KEY_ENV: api_key, PARENT_ENV: str(os.getpid())}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if resolve_device(device).type == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's CPU kernels (else it reaches for CUDA/vLLM ops)
    return env


class SGLangEngine:
    """Engine protocol (tirl.engines.base) on an SGLang server this engine started."""

    def __init__(self, cfg: EngineConfig, name: str = "sglang0", gpu: str | None = None):
        require_sglang()
        if not cfg.model:
            raise ValueError("engine.model is empty: set it to a model directory (e.g. `tirl model init`)")
        self.cfg, self.name = cfg, name
        self._weights = tempfile.mkdtemp(prefix=f"tirl-{name}-", dir=_transfer_root())
        # Without a key any local program (or a web page, by DNS rebinding: SGLang checks no Host)
        # could generate or reload the weights. Random per server, kept in memory only.
        api_key = secrets.token_urlsafe(32)
        for attempt in range(1, START_TRIES + 1):
            try:
                self._start(cfg, name, gpu, api_key)
                return
            except ServerExited:
                # Most often the free port was taken before the server bound it (another process's
                # outgoing connection or server): a new port. Its own failures repeat, and are raised.
                self._stop_server(keep_weights=attempt < START_TRIES)
                if attempt == START_TRIES:
                    raise
            except BaseException:
                self._stop_server()
                raise

    def _start(self, cfg: EngineConfig, name: str, gpu: str | None, api_key: str) -> None:
        self.port = free_port()
        self._proc = subprocess.Popen(
            sglang_server_command(cfg, self.port),
            env=server_env(api_key, gpu, cfg.device),
            stdin=subprocess.DEVNULL,
            process_group=0,  # its own group: Ctrl-C reaches tirl, which stops it in order
        )
        servers = RemoteServers(
            urls=[f"http://127.0.0.1:{self.port}"],
            api="sglang",
            api_key=api_key,
            weights_dir=self._weights,
            start_timeout_s=1800,
        )
        remote = cfg.model_copy(update={"remote": servers})
        self._server = ServerEngine(remote, servers.urls[0], name, exited=self._proc.poll)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if self._proc.poll() is not None:
            raise RuntimeError(f"{self.name}: the SGLang server exited with code {self._proc.returncode}")
        return await self._server.generate(prompt_ids, params)

    def capacity(self) -> KVCapacity:
        return self._server.capacity()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """In place: written to shared memory, reloaded by the server, then its radix cache flushed."""
        self._server.load_weights(weights)

    def reset_prefix_cache(self) -> None:
        self._server.reset_prefix_cache()

    def sleep(self) -> bool:
        return self._server.sleep()

    def wake_up(self) -> None:
        self._server.wake_up()

    async def close(self) -> None:
        await self._server.close()
        self._stop_server()

    def _stop_server(self, keep_weights: bool = False) -> None:
        proc = getattr(self, "_proc", None)  # None: Popen itself failed
        if proc is not None:
            stop_child(proc, 30, group=True)
        if not keep_weights:
            shutil.rmtree(self._weights, ignore_errors=True)


def _transfer_root() -> str:
    shm = Path("/dev/shm")
    return os.environ.get("TIRL_WEIGHTS_DIR") or (str(shm) if shm.is_dir() else tempfile.gettempdir())
