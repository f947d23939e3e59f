"""The `cluster` section: where engines, trainer ranks and sandboxes run (`backend: local | ray`).

    cluster:
      backend: ray            # local (default): one process tree; ray: actors placed across nodes
      address: auto           # auto | HOST:PORT | null (start a private Ray on this machine)
      engines: {num_gpus: 1}  # per engine actor (engine.num_engines of them)
      trainer: {ranks: 8, num_gpus: 1}
      colocate: true          # engine i shares trainer rank i's GPU (and sleeps while it trains)

The number of engines stays `engine.num_engines` (one definition); this section only says what each
one needs and where the rest goes.
"""

from __future__ import annotations

import math
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

RAY_MISSING = "cluster.backend=ray needs Ray, which is not installed: `pip install 'tirl[ray]'`"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Resources(_Strict):
    """What one actor reserves on its node (Ray logical resources)."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(
        default_factory=dict
    )  # custom node resources, e.g. {"engine_node": 1}

    def as_bundle(self) -> dict[str, float]:
        bundle = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {k: v for k, v in bundle.items() if v > 0}


class TrainerPlacement(Resources):
    ranks: int = Field(1, ge=1)  # trainer worker actors, one per FSDP rank (backend=ray)


class SandboxPlacement(_Strict):
    """One `tirl sandbox serve` per node that has `resource` (every alive node when it is null)."""

    per_node: bool = True  # false: keep the `sandbox` section's mode; sandbox.mode=remote is always kept
    resource: str | None = (
        None  # e.g. "sandbox_node": only nodes started with --resources '{"sandbox_node": 1}'
    )
    num_cpus: float = Field(1.0, ge=0)  # reserved on each of those nodes for the service
    health_interval_s: float = Field(5.0, gt=0)  # restart a service that stops answering /health


class ClusterConfig(_Strict):
    backend: Literal["local", "ray"] = "local"
    address: str | None = None  # ray: "auto" (a running cluster), "HOST:PORT", or null (start one here)
    namespace: str = "tirl"
    engines: Resources = Resources()
    trainer: TrainerPlacement = TrainerPlacement()
    # true: engine i and trainer rank i share one bundle (its GPU), engines sleep while the trainer runs
    # (tirl.runtime.ray_cluster); false: separate device pools (disaggregated), engines never sleep.
    colocate: bool = False
    weight_sync_bucket_mb: float = Field(
        256.0, gt=0
    )  # trainer -> engines in buckets of this size (verl: 128-1024)
    sandbox: SandboxPlacement = SandboxPlacement()
    reward_num_cpus: float = Field(1.0, ge=0)  # the reward actor (math-verify workers) off the driver
    num_cpus: int | None = Field(None, ge=1)  # a Ray started by tirl (address null): logical CPUs

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if self.backend == "local":
            if self.address is not None:
                raise ValueError("cluster.address is for backend=ray; set cluster.backend=ray or drop it")
            if self.trainer.ranks != 1:
                raise ValueError(
                    "cluster.trainer.ranks is for backend=ray; under backend=local launch ranks with "
                    "`torchrun --nproc_per_node=N -m tirl.cli train ...`"
                )
            if self.colocate:
                raise ValueError(
                    "cluster.colocate is for backend=ray; backend=local is colocated already (engine i runs "
                    "on cuda:i, next to torchrun rank i)"
                )
        else:
            if self.colocate:
                self._check_colocatable()
            try:
                require_ray()
            except ImportError as e:
                raise ValueError(str(e)) from None
        return self

    def _check_colocatable(self) -> None:
        """Colocated engine i and rank i share one bundle's devices: they must ask for the same ones."""
        e, t = self.engines, self.trainer
        if e.num_gpus != t.num_gpus:
            raise ValueError(
                f"cluster.colocate: engine i shares trainer rank i's devices, but cluster.engines.num_gpus="
                f"{e.num_gpus:g} differs from cluster.trainer.num_gpus={t.num_gpus:g}: make them equal, or set "
                "cluster.colocate=false for separate device pools"
            )
        if e.num_gpus > 1:
            raise ValueError(
                f"cluster.colocate: num_gpus={e.num_gpus:g}, but a colocated engine and rank share one GPU "
                "(each takes half of it; with more Ray would hand them different GPUs): set num_gpus to 1"
            )
        if e.resources != t.resources:
            raise ValueError(
                f"cluster.colocate: cluster.engines.resources={e.resources} and cluster.trainer.resources="
                f"{t.resources} differ, but a colocated engine and rank share one bundle: make them equal"
            )

    def logical_cpus(self, num_engines: int, trainer_ranks: int = 0) -> float:
        """The Ray logical CPUs a run's actors reserve (backend=ray): the engine actors, the trainer
        workers, one sandbox service (on one machine: per_node), the reward actor. Logical CPUs are a
        scheduling unit Ray counts, not cores: actors asking 1 each may share one core."""
        need = num_engines * self.engines.num_cpus + trainer_ranks * self.trainer.num_cpus
        return need + (self.sandbox.num_cpus if self.sandbox.per_node else 0.0) + self.reward_num_cpus

    def private_ray_cpus(self, num_engines: int, trainer_ranks: int = 0) -> int:
        """The logical CPUs of a Ray tirl starts here (address null): cluster.num_cpus when set, else
        the cores or what the actors need, whichever is more (a 2-core machine runs a config asking for
        5 actors of 1 CPU each: they take turns on the cores, as processes do)."""
        if self.num_cpus is not None:
            return self.num_cpus
        return max(os.cpu_count() or 1, math.ceil(self.logical_cpus(num_engines, trainer_ranks) - 1e-9))

    def check_private_cpus(self, num_engines: int, trainer_ranks: int = 0) -> None:
        """ConfigError-worthy (ValueError) when cluster.num_cpus cannot hold the run's actors."""
        need = self.logical_cpus(num_engines, trainer_ranks)
        if (
            self.backend == "ray"
            and self.address is None
            and self.num_cpus is not None
            and need > self.num_cpus
        ):
            raise ValueError(
                f"cluster.num_cpus={self.num_cpus} is fewer logical CPUs than the run's actors reserve "
                f"({self.cpu_breakdown(num_engines, trainer_ranks)} = {need:g}): raise cluster.num_cpus to "
                f"{math.ceil(need)} or drop it (tirl then gives its Ray what the actors need)"
            )

    def cpu_breakdown(self, num_engines: int, trainer_ranks: int = 0) -> str:
        """`logical_cpus` spelled out with the settings that make it, for error messages."""
        parts = [f"{num_engines} engines x cluster.engines.num_cpus={self.engines.num_cpus:g}"]
        if trainer_ranks:
            parts.append(
                f"{trainer_ranks} trainer ranks x cluster.trainer.num_cpus={self.trainer.num_cpus:g}"
            )
        if self.sandbox.per_node:
            parts.append(f"cluster.sandbox.num_cpus={self.sandbox.num_cpus:g} per node")
        parts.append(f"cluster.reward_num_cpus={self.reward_num_cpus:g}")
        return " + ".join(parts)

    @property
    def colocated(self) -> bool:
        """Engines share devices with trainer ranks: backend=local always (engine i on cuda:i, next to
        torchrun rank i), backend=ray when `colocate` puts engine i in rank i's bundle. Such engines
        lend their memory to the trainer while it trains (tirl.runtime.handoff)."""
        return self.backend == "local" or self.colocate


def require_ray():
    """The `ray` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(RAY_MISSING) from e
    return ray
