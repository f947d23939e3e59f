"""Getting a real sandbox without starting one by hand: `SandboxConfig` + `open_executor`.

    async with open_executor(SandboxConfig(mode="local")) as ex:
        r = await ex.run("print(1)")

mode "local" spawns `tirl sandbox serve` on a free loopback port and talks HTTP to it (the
service is isolated from the caller's process: a crash or leak there cannot hurt training);
"remote" talks to running services; "inprocess" runs a Sandbox pool inside this event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tirl import lifetime
from tirl.config import SANDBOX_TOKEN_ENV, secret_or_env
from tirl.ports import free_port
from tirl.sandbox.client import SandboxClient
from tirl.sandbox.limits import DEFAULT_LIMITS, Limits, MiB
from tirl.sandbox.pool import STDLIB, Sandbox, resolve_preload
from tirl.sandbox.result import Executor

SandboxToken = secret_or_env(SANDBOX_TOKEN_ENV)


class SandboxConfig(BaseModel):
    """How trainer/eval code reaches the code execution service."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["local", "remote", "inprocess"] = "local"
    endpoints: list[str] = Field(default_factory=list, description="service URLs (mode=remote)")
    token: SandboxToken = Field(
        None,
        description="bearer token of the remote services (env:NAME, file:PATH; null: $TIRL_SANDBOX_TOKEN)",
    )
    slots: int | None = Field(None, ge=1, description="parallel executions (default: CPU cores)")
    timeout_s: float = Field(DEFAULT_LIMITS.timeout_s, gt=0, description="default wall-time limit per call")
    memory_mb: int = Field(DEFAULT_LIMITS.memory_mb, ge=32)
    output_bytes: int = Field(DEFAULT_LIMITS.output_bytes, ge=1024, description="hard output cap per call")
    keep_bytes: int = Field(DEFAULT_LIMITS.keep_bytes, ge=256, description="head/tail kept per stream")
    max_procs: int = Field(DEFAULT_LIMITS.max_procs, ge=1)
    queue_timeout_s: float = Field(60.0, gt=0, description="longest wait for a free slot")
    batch_size: int = Field(64, ge=1, description="client batch size (send workers)")
    max_wait_ms: float = Field(2.0, ge=0, description="longest a batch waits to fill")
    concurrency: int = Field(64, ge=1, description="calls in flight per endpoint")
    retries: int = Field(3, ge=0, description="retries of infrastructure failures")
    start_timeout_s: float = Field(180.0, gt=0, description="mode=local: wait this long for /health")
    preload: list[str] | Literal["stdlib"] | None = Field(
        None,
        description="modules each slot imports once at start (local, inprocess; null: numpy, sympy, scipy "
        "and the error-path stdlib; 'stdlib': that list's standard-library part, which starts a slot "
        "~10x faster)",
    )

    @field_validator("preload")
    @classmethod
    def _importable(cls, preload: list[str] | str | None) -> list[str] | str | None:
        """A name no slot could import fails with the config, before any phase starts a sandbox."""
        resolve_preload(preload)
        return preload

    def limits(self) -> Limits:
        return Limits(
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            output_bytes=self.output_bytes,
            keep_bytes=self.keep_bytes,
            max_procs=self.max_procs,
        )

    def client(self, endpoints: list[str], token: str | None) -> SandboxClient:
        return SandboxClient(
            endpoints,
            token=token,
            concurrency=self.concurrency,
            batch_size=self.batch_size,
            max_wait_ms=self.max_wait_ms,
            retries=self.retries,
            timeout=self.timeout_s,
        )


def serve_command(cfg: SandboxConfig, host: str, port: int) -> list[str]:
    """The `tirl sandbox serve` command line for cfg's limits (the token goes in $TIRL_SANDBOX_TOKEN)."""
    argv = [
        sys.executable,
        "-m",
        "tirl.cli",
        "sandbox",
        "serve",
        "--host",
        host,
        "--port",
        str(port),
        "--timeout",
        str(cfg.timeout_s),
        "--memory-mb",
        str(cfg.memory_mb),
        "--output-bytes",
        str(cfg.output_bytes),
        "--keep-bytes",
        str(cfg.keep_bytes),
        "--max-procs",
        str(cfg.max_procs),
        "--queue-timeout",
        str(cfg.queue_timeout_s),
    ]
    if cfg.slots:
        argv += ["--slots", str(cfg.slots)]
    if cfg.preload is not None:
        argv += ["--preload", cfg.preload if cfg.preload == STDLIB else ",".join(cfg.preload)]
    return argv


async def _wait_healthy(url: str, token: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"`tirl sandbox serve` exited with code {proc.returncode} before it was healthy"
                )
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(f"{url}/health", timeout=2)).status_code == 200:
                    return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"`tirl sandbox serve` was not healthy within {timeout_s:g} s")


@contextlib.asynccontextmanager
async def _local_service(cfg: SandboxConfig) -> AsyncIterator[SandboxClient]:
    port, token = free_port(), secrets.token_urlsafe(24)
    argv = serve_command(cfg, "127.0.0.1", port)
    # The token never shows in `ps`; the service dies with this process even when it is killed
    # (tirl.lifetime), whether or not it is a tirl command (a script, a benchmark, a test).
    env = {**os.environ, SANDBOX_TOKEN_ENV: token, lifetime.ENV: str(os.getpid())}
    # Its own process group: Ctrl-C in the terminal (e.g. stopping one `tirl chat` answer) reaches the
    # parent, which stops the service in order, not the service itself. It dies with its parent
    # (tirl.lifetime).
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, process_group=0)
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_healthy(url, token, proc, cfg.start_timeout_s)
        async with cfg.client([url], token) as client:
            yield client
    finally:
        await asyncio.to_thread(lifetime.stop_child, proc, 15)


@contextlib.asynccontextmanager
async def open_executor(cfg: SandboxConfig | None = None) -> AsyncIterator[Executor]:
    """An object with `async run(code, stdin="", timeout=None) -> ExecResult`, cleaned up on exit."""
    cfg = cfg or SandboxConfig()
    if cfg.mode == "remote":
        if not cfg.endpoints:
            raise ValueError("SandboxConfig(mode='remote') needs endpoints, e.g. ['http://host:8080']")
        async with cfg.client(cfg.endpoints, cfg.token) as client:
            yield client
    elif cfg.mode == "local":
        async with _local_service(cfg) as client:
            yield client
    else:
        async with Sandbox(
            slots=cfg.slots, limits=cfg.limits(), queue_timeout_s=cfg.queue_timeout_s, preload=cfg.preload
        ) as sandbox:
            yield sandbox


__all__ = ["Executor", "MiB", "SandboxConfig", "open_executor", "serve_command"]
