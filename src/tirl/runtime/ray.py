"""The `ray` runtime: engines, sandboxes and reward workers placed across nodes (the trainer ranks:
tirl.rl.ray_learner; where each actor goes: tirl.runtime.ray_cluster; the torch-free sandbox-node and
reward actors: tirl.runtime.ray_services).

    driver (tirl train: rl_step top to bottom)
      ├─ EngineWorker actors (their placement slots: engine i on any node, or sharing trainer rank i's
      │    bundle with cluster.colocate) <- RemoteEngine proxies behind the KV-aware RolloutScheduler;
      │    generate() is an awaited remote call
      ├─ TrainerWorker actors, one per rank, one torch.distributed group (tirl.rl.ray_learner)
      ├─ SandboxNode actor per node: starts, health-checks, restarts `tirl sandbox serve`;
      │    the SandboxClient balances over their endpoints (and retries elsewhere)
      └─ RewardWorker actor: the math-verify process pool, off the driver
    weight sync: trainer rank 0 + every engine's worker form one sync group, reused by every sync
    (tirl.distributed.weight_sync); a vLLM engine's worker process itself is the member

Faults: an engine actor that dies mid-rollout is marked down and the turns it was running (and any
later ones of its trajectories) are re-run on live engines with the same prompt tokens and seed, so
no trajectory is lost or scored on a broken turn; Ray restarts the actor, which rejoins at the next
weight sync (before that it holds stale weights, so it gets no work). Counted in `infra/*` metrics.
A sandbox service that dies is restarted by its node's actor; meanwhile the client retries its
calls on the other nodes.

The sync group is persistent, as in the big frameworks: formed at the first sync, reused, and formed
anew only when its members change (an engine Ray restarted joins the next one); each member shuts its
end down when it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

import torch

from tirl.distributed.weight_sync import SyncChannel, SyncGroup, WorkerReceiver, receive_into
from tirl.engines.base import Generation, GroupReceiver, KVCapacity, SamplingParams, StagedWake
from tirl.engines.fleet import EngineFleet
from tirl.engines.vllm import WeightSyncExtension
from tirl.runtime.base import Runtime
from tirl.runtime.config import ClusterConfig
from tirl.runtime.ray_cluster import (
    READY_TIMEOUT_S,
    ClusterError,
    Placement,
    Slot,
    await_scheduled,
    connect,
    node_ip,
    open_placement,
    whereabouts,
)
from tirl.runtime.ray_services import RemoteScorer, RewardWorker, sandbox_fleet, sandbox_nodes

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tirl.engines.config import EngineConfig
    from tirl.reward import RewardConfig
    from tirl.sandbox import SandboxConfig

# ---- engines -------------------------------------------------------------------------------------


class SyncWorkerExtension(WeightSyncExtension, WorkerReceiver):
    """vLLM's worker extension on Ray: the engine's in-place reload plus a sync-group receiver, so the
    buckets go from trainer rank 0 straight into the worker process that owns the weights."""


class EngineWorker:
    """One inference engine (HF or vLLM) in its own actor process; Ray restarts it if it dies."""

    def __init__(self, cfg: EngineConfig):
        from tirl.engines.factory import build_engines

        cfg = cfg.model_copy(update={"num_engines": 1})
        if cfg.backend == "vllm":
            from tirl.engines.vllm import VLLMEngine

            extension = f"{SyncWorkerExtension.__module__}.{SyncWorkerExtension.__qualname__}"
            self.engine = VLLMEngine(cfg, "vllm0", worker_extension=extension)
        else:
            self.engine = build_engines(cfg)[0]
        self.ranks = cfg.tensor_parallel_size if cfg.backend == "vllm" else 1  # sync-group ranks it takes
        self.channel: SyncChannel | None = None  # an engine that loads in this process (hf)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> tuple[Generation, KVCapacity]:
        generation = await self.engine.generate(prompt_ids, params)
        return generation, self.engine.capacity()

    async def describe(self) -> dict[str, Any]:
        dtype = getattr(self.engine, "dtype", None)
        return whereabouts() | {
            "capacity": self.engine.capacity(),
            "dtype": str(dtype) if dtype is not None else None,
            "ranks": self.ranks,
        }

    async def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        await asyncio.to_thread(self.engine.load_weights, weights)

    async def join_sync(self, group: SyncGroup, rank: int) -> None:
        """Join the persistent sync group: inside the vLLM worker, or here for an in-process engine."""
        await self.leave_sync()
        address = node_ip()  # gloo listens here: the hostname may resolve to loopback
        if isinstance(self.engine, GroupReceiver):
            await asyncio.to_thread(self.engine.join_sync_group, group.as_dict(), rank, address)
        else:
            self.channel = await asyncio.to_thread(SyncChannel, group, rank, address)

    async def receive_sync(self) -> int:
        """One sync, loaded whole (one reload): generation never sees a half-updated model."""
        if isinstance(self.engine, GroupReceiver):
            return await asyncio.to_thread(self.engine.receive_sync)
        if self.channel is None or self.channel.pg is None:
            raise RuntimeError("receive_sync before join_sync")
        device = torch.device("cuda") if self.channel.group.backend == "nccl" else torch.device("cpu")
        return await asyncio.to_thread(receive_into, self.channel.pg, self.engine.load_weights, device)

    async def leave_sync(self) -> None:
        if isinstance(self.engine, GroupReceiver):
            await asyncio.to_thread(self.engine.leave_sync_group)
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    async def sleep(self, discard_weights: bool = False) -> bool:
        if isinstance(self.engine, StagedWake):
            return await asyncio.to_thread(self.engine.sleep, discard_weights)
        return await asyncio.to_thread(self.engine.sleep)

    async def wake_weights(self) -> None:
        if isinstance(self.engine, StagedWake):
            await asyncio.to_thread(self.engine.wake_weights)

    async def wake_up(self) -> None:
        await asyncio.to_thread(self.engine.wake_up)

    async def close(self) -> None:
        with contextlib.suppress(Exception):  # a group whose other members are gone already
            await self.leave_sync()
        await self.engine.close()


class RemoteEngine:
    """The Engine interface on an EngineWorker actor; a turn it cannot finish goes to a live engine."""

    def __init__(self, fleet: ActorFleet, actor, name: str, node: str, capacity: KVCapacity, info=None):
        self.fleet, self.actor, self.name, self.node = fleet, actor, name, node
        self._capacity = capacity
        info = info or {}
        self.dtype: str | None = info.get("dtype")  # the engine's weights' dtype: what a sync sends
        self.ranks: int = info.get("ranks", 1)  # its members in the sync group (tensor-parallel workers)
        self.up = True  # False from its first failure until the weight sync after Ray restarted it
        self.revived = False

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        import ray

        if self.up:
            try:
                generation, self._capacity = await self.actor.generate.remote(prompt_ids, params)
                return generation
            except ray.exceptions.RayActorError:
                self.fleet.lost(self, "its actor died")
        return await self.fleet.reroute(self, prompt_ids, params)

    def capacity(self) -> KVCapacity:
        # The last value the actor reported (a remote call here would block the event loop); a
        # down engine offers no room.
        if not self.up:
            return KVCapacity(self._capacity.total_tokens, 0, self._capacity.preemptions)
        return self._capacity

    def load_weights(self, weights) -> None:
        import ray

        ray.get(self.actor.load_weights.remote(list(weights)))

    def sleep(self, discard_weights: bool = False) -> bool:
        import ray

        return self.up and ray.get(self.actor.sleep.remote(discard_weights))

    def wake_weights(self) -> None:
        import ray

        if self.up:
            ray.get(self.actor.wake_weights.remote())

    def wake_up(self) -> None:
        import ray

        if self.up:
            ray.get(self.actor.wake_up.remote())

    async def close(self) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayActorError):
            await self.actor.close.remote()


class ActorFleet(EngineFleet):
    """All engine actors: failover (tirl.engines.fleet) and their revival after Ray restarted them."""

    def none_live(self) -> Exception:
        return ClusterError("every engine actor is down: no engine can run this turn")

    def sync_targets(self, timeout_s: float = READY_TIMEOUT_S) -> list[RemoteEngine]:
        """Engines that take part in the next weight sync: the live ones and those Ray restarted
        (a restarted actor answers once it has loaded its model again)."""
        import ray

        deadline = time.monotonic() + timeout_s
        for e in self.engines:
            while not (e.up or e.revived) and time.monotonic() < deadline:
                try:
                    info = ray.get(e.actor.describe.remote(), timeout=max(1.0, deadline - time.monotonic()))
                    e.node, e._capacity, e.revived = info["node"], info["capacity"], True
                except ray.exceptions.ActorUnavailableError:  # restarting: calls fail until it is back
                    time.sleep(0.2)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    break  # gone for good (no restarts left) or too slow: it sits this sync out
        return [e for e in self.engines if e.up or e.revived]


async def _start_engines(ray, slots: list[Slot], cfg: EngineConfig, fleet: ActorFleet) -> None:
    actor_cls = ray.remote(EngineWorker)
    run = secrets.token_hex(4)  # names (`ray list actors`, operators) unique per runtime
    actors = [
        actor_cls.options(
            name=f"tirl-engine{i}-{run}",
            max_restarts=2,  # Ray brings a dead engine back; it rejoins at the next weight sync
            max_concurrency=10_000,  # every in-flight trajectory's generate() is one concurrent call
            **slot.options(),
        ).remote(cfg)
        for i, slot in enumerate(slots)
    ]
    infos = await asyncio.gather(*(a.describe.remote() for a in actors))
    for i, (actor, info) in enumerate(zip(actors, infos, strict=True)):
        fleet.engines.append(
            RemoteEngine(fleet, actor, f"{cfg.backend}{i}", info["node"], info["capacity"], info)
        )


# ---- the runtime -----------------------------------------------------------------------------------


@asynccontextmanager
async def open_ray_runtime(
    cluster: ClusterConfig,
    engine: EngineConfig,
    sandbox: SandboxConfig,
    reward: RewardConfig | None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    placement: Placement | None = None,
) -> AsyncIterator[Runtime]:
    """Engine actors in `placement`'s engine slots (a placement of their own when None: eval, chat,
    filter-hard), a sandbox service per node, the reward actor; all gone on exit."""
    from tirl.engines.factory import build_pool
    from tirl.engines.tokenizer import load_tokenizer
    from tirl.sandbox import open_executor

    ray = connect(cluster)
    tokenizer = tokenizer or load_tokenizer(engine.model)
    counters: dict[str, int] = {}
    fleet = ActorFleet(counters)
    # A fleet the user runs (sandbox.mode=remote) is used as given; otherwise one service per node.
    per_node = cluster.sandbox.per_node and sandbox.mode != "remote"
    nodes = sandbox_nodes(ray, cluster) if per_node else []
    async with AsyncExitStack() as stack:
        if placement is None:
            placement = stack.enter_context(open_placement(cluster, engine.num_engines))
        try:
            await _start_engines(ray, placement.engines, engine, fleet)
            if nodes:
                executor = await stack.enter_async_context(
                    sandbox_fleet(ray, cluster, sandbox, nodes, counters)
                )
            else:
                executor = await stack.enter_async_context(open_executor(sandbox))
            scorer = None
            if reward is not None:
                actor = ray.remote(RewardWorker).options(num_cpus=cluster.reward_num_cpus).remote()
                stack.callback(ray.kill, actor)
                await await_scheduled(ray, [actor], "reward_num_cpus", cluster.reward_num_cpus)
                await actor.start.remote(reward)
                scorer = RemoteScorer(actor)
            engines = list(fleet.engines)
            pool = build_pool(engines, engine)
            yield Runtime(engines, pool, executor, scorer, tokenizer, "ray", counters, fleet=fleet)
        finally:
            await asyncio.gather(*(e.close() for e in fleet.engines), return_exceptions=True)
            for e in fleet.engines:
                ray.kill(e.actor)


__all__ = ["RemoteEngine", "SyncWorkerExtension", "open_ray_runtime"]
