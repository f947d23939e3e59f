"""The `ray` runtime's actors that need no torch: a `tirl sandbox serve` per node (SandboxNode) and the
math-verify pool (RewardWorker). Ray imports an actor's module in a fresh worker process; kept out of
tirl.runtime.ray (torch, the engines), these start without importing torch (~2 s of CPU each on 2
cores, paid by every runtime a Ray run opens)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from tirl.lifetime import stop_child
from tirl.ports import free_port
from tirl.runtime.ray_cluster import ClusterError, await_scheduled, node_ip

if TYPE_CHECKING:
    from tirl.reward import RewardConfig, RewardStats
    from tirl.runtime.config import ClusterConfig
    from tirl.sandbox import SandboxConfig

# ---- sandboxes -------------------------------------------------------------------------------------


class SandboxNode:
    """Runs `tirl sandbox serve` on its node; `ensure()` restarts it when it stopped answering."""

    def __init__(self, cfg: SandboxConfig, token: str):
        self.cfg, self.token = cfg, token
        self.host, self.port = node_ip(), free_port("")
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def ensure(self) -> dict[str, Any]:
        """Start the service (again) unless it is healthy; its URL, pid and restarts so far."""
        if not self._healthy():
            if self.proc is not None:
                self.restarts += 1
                self._stop()
            self._start()
        return {"url": self.url, "pid": self.proc.pid, "restarts": self.restarts}

    def _start(self) -> None:
        from tirl import lifetime
        from tirl.sandbox.service import serve_command

        # The service dies with this actor (tirl.lifetime): a lost node actor leaves no orphan service.
        env = {**os.environ, "TIRL_SANDBOX_TOKEN": self.token, lifetime.ENV: str(os.getpid())}
        argv = serve_command(self.cfg, self.host, self.port)
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while not self._healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"`tirl sandbox serve` on {self.host} exited with code {self.proc.returncode}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"`tirl sandbox serve` on {self.host} was not healthy within {self.cfg.start_timeout_s:g} s"
                )
            time.sleep(0.2)

    def _healthy(self) -> bool:
        import httpx

        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            headers = {"Authorization": f"Bearer {self.token}"}
            return httpx.get(f"{self.url}/health", headers=headers, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _stop(self) -> None:
        if self.proc is not None:
            stop_child(self.proc, 15)

    def stop(self) -> None:
        self._stop()


def sandbox_nodes(ray, cluster: ClusterConfig) -> list[str]:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    want = cluster.sandbox.resource
    chosen = [n["NodeID"] for n in nodes if want is None or n["Resources"].get(want, 0) > 0]
    if not chosen:
        raise ClusterError(
            f"cluster.sandbox.resource={want!r}: no node of the Ray cluster has it; start sandbox nodes "
            f"with `ray start --resources '{{\"{want}\": 1}}'` or set cluster.sandbox.resource=null"
        )
    return chosen


@asynccontextmanager
async def sandbox_fleet(
    ray, cluster: ClusterConfig, cfg: SandboxConfig, nodes: list[str], counters: dict[str, int]
):
    """One service per chosen node and a client over all of them; a health loop restarts dead ones."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = cfg.token or secrets.token_urlsafe(24)
    actor_cls = ray.remote(SandboxNode)
    actors = [
        actor_cls.options(
            num_cpus=cluster.sandbox.num_cpus,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(cfg, token)
        for node in nodes
    ]
    await await_scheduled(ray, actors, "sandbox.num_cpus", cluster.sandbox.num_cpus)
    states = await asyncio.gather(*(a.ensure.remote() for a in actors))
    counters.setdefault("sandbox_restarts", 0)
    counters.setdefault("sandbox_nodes_lost", 0)
    counters.setdefault("sandbox_restart_failures", 0)
    lost: set[int] = set()

    async def watch() -> None:
        while True:
            await asyncio.sleep(cluster.sandbox.health_interval_s)
            for i, actor in enumerate(actors):
                if i in lost:
                    continue
                try:
                    state = await actor.ensure.remote()
                except ray.exceptions.RayActorError:  # the node (or its actor) is gone
                    lost.add(i)
                    counters["sandbox_nodes_lost"] += 1
                    continue
                except ray.exceptions.RayTaskError:  # a restart failed (e.g. killed while starting):
                    counters["sandbox_restart_failures"] += 1  # try again next round; the client
                    continue  # meanwhile sends calls to the other nodes' services
                counters["sandbox_restarts"] += state["restarts"] - states[i]["restarts"]
                states[i] = state

    watcher = asyncio.create_task(watch())
    try:
        async with cfg.client([s["url"] for s in states], token) as client:
            yield client
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await asyncio.gather(*(a.stop.remote() for a in actors), return_exceptions=True)
        for a in actors:
            ray.kill(a)


# ---- reward --------------------------------------------------------------------------------------


class RewardWorker:
    """tirl.reward.RewardPool (math-verify worker processes) in an actor, off the driver."""

    async def start(self, cfg: RewardConfig) -> None:
        from tirl.reward import RewardPool

        self.pool = RewardPool(cfg)
        await self.pool.start()

    async def score(self, response: str, reference: str) -> float:
        return await self.pool.score(response, reference)

    async def score_many(self, pairs: list[tuple[str, str]]) -> list[float]:
        return await self.pool.score_many(pairs)

    async def equivalent(self, answer: str, reference: str) -> bool:
        return await self.pool.equivalent(answer, reference)

    async def stats(self) -> RewardStats:
        return self.pool.stats

    async def close(self) -> None:
        await self.pool.close()


class RemoteScorer:
    """The Scorer interface on a RewardWorker actor."""

    def __init__(self, actor):
        self.actor = actor

    async def score_many(self, pairs: list[tuple[str, str]]) -> list[float]:
        return await self.actor.score_many.remote(pairs)

    async def equivalent(self, answer: str, reference: str) -> bool:
        return await self.actor.equivalent.remote(answer, reference)

    @property
    def stats(self) -> RewardStats:
        import ray

        return ray.get(self.actor.stats.remote())
