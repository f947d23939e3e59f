"""The Ray cluster tirl runs on: joining it, checking it has what the config asks for, and placing the
engine actors and trainer workers on it (`cluster.colocate`).

    colocate: false (disaggregated)            colocate: true
      engines  PG (SPREAD): [E0] [E1] ...        one PG (PACK): [E0+T0] [E1+T1] ...
      trainer  PG (PACK):   [T0] [T1] ...        engine i and trainer rank i share bundle i

A colocated bundle holds the devices (GPUs, custom resources) once and the CPUs of both actors; each
actor takes half of the shared amounts, so Ray gives engine i and rank i the same GPU (OpenRLHF's
colocation by fractional GPUs; verl's hybrid engine runs both in one process instead). The engines then
release their memory while the trainer runs (Runtime.sleep) where their backend can; the weight sync
goes over gloo then, since NCCL refuses two members of one group on one GPU (tirl.rl.ray_learner).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tirl.lifetime import QUIET_ENV
from tirl.runtime.config import ClusterConfig, Resources, require_ray

READY_TIMEOUT_S = 300.0  # placement groups and actors (loading a model) must be up within this
NOTICE_AFTER_S = 10.0  # a placement group not placed by then: say that tirl waits for it, and why
# Actors outside the placement groups (sandbox services, the reward worker) pending this long: Ray
# would never schedule them (its own wait is forever). Apart from READY_TIMEOUT_S, which also bounds
# placement, so that a test can reach this error in seconds without shortening the placement wait.
SCHEDULE_TIMEOUT_S = READY_TIMEOUT_S


# Ray starts its workers at niceness 15 (background work beside a driver that matters more). tirl's
# actors are the run itself: at 15, any ordinary process on a shared machine takes their CPU (a busy
# loop at niceness 0 left a Ray test's actors ~3% of a core). A cluster that `ray start` made keeps its
# own setting: start it with RAY_worker_niceness=0 (docs/scaling.md).
PRIVATE_RAY_CONFIG = {"worker_niceness": 0}


class ClusterError(RuntimeError):
    """The Ray cluster cannot run what the config asks for; the message says what and why."""


def connect(cluster: ClusterConfig, num_engines: int = 1, trainer_ranks: int = 0):
    """Join cluster.address (or start a private Ray here when it is null, with the logical CPUs that
    `num_engines` engine actors and `trainer_ranks` trainer workers need); returns the ray module."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    options: dict[str, Any] = {
        "namespace": cluster.namespace,
        "include_dashboard": False,
        "log_to_driver": True,
    }
    if os.environ.get(QUIET_ENV) == "1":  # a tirl command without --verbose: Ray's notices off (its
        options["logging_level"] = logging.ERROR  # start-up and token-authentication lines)
    if cluster.address is None:
        # address="local": a new Ray of its own; with no address Ray joins a cluster that `ray start`
        # left running on this machine, and refuses num_cpus there.
        ray.init(
            address="local",
            num_cpus=cluster.private_ray_cpus(num_engines, trainer_ranks),
            _system_config=PRIVATE_RAY_CONFIG,
            **options,
        )
        return ray
    if cluster.address != "auto":
        host, _, port = cluster.address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except (OSError, ValueError) as e:
            raise ClusterError(
                f"cannot reach the Ray cluster at cluster.address={cluster.address!r} ({e}): start its head "
                "with `ray start --head --port=6379` and give HEAD_IP:6379, or `auto` on a cluster node"
            ) from e
    try:
        ray.init(address=cluster.address, **options)
    except ConnectionError as e:
        raise ClusterError(f"cannot join the Ray cluster at cluster.address={cluster.address!r}: {e}") from e
    return ray


def check_resources(ray, what: str, bundle: dict[str, float], count: int) -> None:
    """Fail fast, naming the resource, when `count` bundles like `bundle` can never be placed."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    for key, amount in bundle.items():
        have = [n["Resources"].get(key, 0.0) for n in nodes]
        if max(have, default=0.0) < amount:
            raise ClusterError(
                f"cluster.{what} asks for {amount:g} {key!r} per actor, but no node of the Ray cluster has "
                f"that much (largest: {max(have, default=0.0):g}, over {len(nodes)} nodes): lower it or add "
                + (
                    f"nodes with `ray start --num-{key.lower()}s N`"
                    if key in ("CPU", "GPU")
                    else f"nodes with `ray start --resources '{{\"{key}\": N}}'`"
                )
            )
        if sum(have) < amount * count:
            raise ClusterError(
                f"cluster.{what}: {count} actors x {amount:g} {key!r} = {amount * count:g}, but the Ray "
                f"cluster has {sum(have):g} {key!r} in all"
            )


def check_cluster_cpus(ray, cluster: ClusterConfig, num_engines: int, trainer_ranks: int) -> None:
    """Fail at once, naming the settings, when the run's actors ask for more logical CPUs than the
    whole Ray cluster has: Ray would keep the last of them pending forever."""
    check_resources(ray, "engines", cluster.engines.as_bundle(), num_engines)  # per actor first: the
    if trainer_ranks:  # sharper message when one actor alone is too large for any node
        check_resources(ray, "trainer", cluster.trainer.as_bundle(), trainer_ranks)
    need = cluster.logical_cpus(num_engines, trainer_ranks)
    have = sum(n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive"))
    if need > have + 1e-9:
        where = "this machine's Ray (cluster.num_cpus)" if cluster.address is None else "the Ray cluster"
        raise ClusterError(
            f"the run's actors reserve {need:g} logical CPUs ({cluster.cpu_breakdown(num_engines, trainer_ranks)}) "
            f"but {where} has {have:g}: lower those settings (fractions are fine: logical CPUs are a "
            "scheduling unit, not cores), or add CPUs (`ray start --num-cpus N`)"
        )


async def await_scheduled(ray, actors: list[Any], key: str, num_cpus: float) -> None:
    """Fail fast, with what to change, when actors that ask for `num_cpus` outside the placement groups
    are not running within SCHEDULE_TIMEOUT_S: Ray would keep them pending forever, e.g. when the
    colocated bundles took every CPU of the node (each rank's bundle holds engines + trainer CPUs)."""
    try:
        await asyncio.wait_for(
            asyncio.gather(*(a.__ray_ready__.remote() for a in actors)), SCHEDULE_TIMEOUT_S
        )
    except TimeoutError:
        for actor in actors:
            ray.kill(actor)
        free = ray.available_resources().get("CPU", 0.0)
        raise ClusterError(
            f"{len(actors)} actor(s) of cluster.{key}={num_cpus:g} CPUs were not scheduled within "
            f"{SCHEDULE_TIMEOUT_S:g} s ({free:g} CPUs free beside the engine and trainer bundles): leave "
            f"them room (lower cluster.engines.num_cpus / cluster.trainer.num_cpus, or add CPUs) or "
            f"lower cluster.{key}"
        ) from None


# ---- placement ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """Where one actor goes: bundle `bundle` of placement group `group`, of which it takes `takes`."""

    group: Any  # ray.util.placement_group.PlacementGroup
    bundle: int
    takes: Resources

    def options(self) -> dict[str, Any]:
        """Ray actor options that put the actor in its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {
            "num_cpus": self.takes.num_cpus,
            "num_gpus": self.takes.num_gpus,
            "resources": dict(self.takes.resources),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=self.bundle
            ),
        }


@dataclass
class Placement:
    """The slots of the engine actors and of the trainer workers (empty for eval: no trainer)."""

    engines: list[Slot]
    trainer: list[Slot] = field(default_factory=list)
    groups: list[Any] = field(default_factory=list)  # removed when the placement closes


def colocated_shares(engines: Resources, trainer: Resources) -> tuple[dict[str, float], Resources, Resources]:
    """The bundle that engine i and trainer rank i share, and what each of them takes of it: the
    devices (GPUs, custom resources; equal for both, ClusterConfig checks) once, split in half, and
    the CPUs of both."""
    bundle = Resources(
        num_cpus=engines.num_cpus + trainer.num_cpus, num_gpus=engines.num_gpus, resources=engines.resources
    ).as_bundle()
    half = {k: v / 2 for k, v in engines.resources.items()}
    engine_takes = Resources(num_cpus=engines.num_cpus, num_gpus=engines.num_gpus / 2, resources=half)
    trainer_takes = Resources(num_cpus=trainer.num_cpus, num_gpus=trainer.num_gpus / 2, resources=half)
    return bundle, engine_takes, trainer_takes


def _placement_group(ray, what: str, bundle: dict[str, float], count: int, strategy: str):
    from ray.util.placement_group import placement_group

    check_resources(ray, what, bundle, count)
    pg = placement_group([dict(bundle) for _ in range(count)], strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=NOTICE_AFTER_S)
    if not ready:  # say why nothing happens: the resources exist, other work holds them
        print(
            f"waiting up to {READY_TIMEOUT_S:g} s for the Ray cluster to free {count} x {bundle} for "
            f"cluster.{what} (held by other work)",
            file=sys.stderr,
            flush=True,
        )
        ready, _ = ray.wait([pg.ready()], timeout=READY_TIMEOUT_S - NOTICE_AFTER_S)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise ClusterError(
            f"cluster.{what}: {count} x {bundle} could not be placed within {READY_TIMEOUT_S:g} s "
            "(the resources exist but are held by other work)"
        )
    return pg


@contextmanager
def open_placement(cluster: ClusterConfig, num_engines: int, trainer_ranks: int = 0) -> Iterator[Placement]:
    """Reserve the bundles of `num_engines` engine actors and `trainer_ranks` trainer workers
    (cluster.colocate: shared, one per rank; else separate groups, the trainer's packed and placed
    first, the engines' spread); released on exit."""
    ray = connect(cluster, num_engines, trainer_ranks)
    check_cluster_cpus(ray, cluster, num_engines, trainer_ranks)
    groups: list[Any] = []
    try:
        if cluster.colocate and trainer_ranks:
            if num_engines != trainer_ranks:  # TrainConfig says so first; this guards other callers
                raise ClusterError(
                    f"cluster.colocate: {num_engines} engines cannot share the devices of {trainer_ranks} "
                    "trainer ranks one to one: set engine.num_engines = cluster.trainer.ranks"
                )
            bundle, engine_takes, trainer_takes = colocated_shares(cluster.engines, cluster.trainer)
            groups.append(_placement_group(ray, "engines+trainer (colocated)", bundle, trainer_ranks, "PACK"))
            engines = [Slot(groups[0], i, engine_takes) for i in range(num_engines)]
            trainer = [Slot(groups[0], r, trainer_takes) for r in range(trainer_ranks)]
        else:
            # The trainer ranks first, packed: their collectives run every step, so they get a node's
            # devices together before the engines spread over what is left (placed first, SPREAD would
            # take a device on every node and split the ranks over nodes).
            trainer = []
            if trainer_ranks:
                trainer_group = _placement_group(
                    ray, "trainer", cluster.trainer.as_bundle(), trainer_ranks, "PACK"
                )
                groups.append(trainer_group)
                trainer = [Slot(trainer_group, r, cluster.trainer) for r in range(trainer_ranks)]
            engine_group = _placement_group(
                ray, "engines", cluster.engines.as_bundle(), num_engines, "SPREAD"
            )
            groups.append(engine_group)
            engines = [Slot(engine_group, i, cluster.engines) for i in range(num_engines)]
        yield Placement(engines, trainer, groups)
    finally:
        for pg in groups:
            ray.util.remove_placement_group(pg)


def whereabouts() -> dict[str, Any]:
    """Where the calling actor runs: its node, placement group and bundle, GPU ids and pid."""
    import ray

    ctx = ray.get_runtime_context()
    pg = ctx.get_placement_group_id()
    return {
        "node": ctx.get_node_id(),
        "placement_group": pg,
        "gpu_ids": ray.get_gpu_ids(),
        "pid": os.getpid(),
    }


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()
