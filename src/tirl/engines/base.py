"""One interface for token-in/token-out generation, KV capacity and weight loading."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 1024
    stop_token_ids: list[int] = field(default_factory=list)  # generation ends after emitting one of these
    stop_strings: list[str] = field(default_factory=list)  # e.g. "</tool_call>": ends a turn early
    seed: int | None = None


@dataclass
class Generation:
    token_ids: list[int]  # exactly the sampled ids, never re-tokenized
    logprobs: list[float]  # logprob of each sampled id under the sampling distribution
    finish_reason: FinishReason
    version: int = 0  # the policy version it was generated with (tirl.engines.versions; 0: not counted)


@dataclass
class KVCapacity:
    total_tokens: int | None  # None when the backend cannot tell
    free_tokens: int | None
    preemptions: int = 0


@runtime_checkable
class Engine(Protocol):
    """Backends: tirl.engines.hf.HFEngine, tirl.engines.vllm.VLLMEngine."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...

    def capacity(self) -> KVCapacity: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def sleep(self) -> bool:
        """Free this engine's device memory (weights, KV cache) while a colocated trainer runs; False
        where there is nothing the backend can free (CPU). No generate() until wake_up()."""
        ...

    def wake_up(self) -> None: ...

    async def close(self) -> None: ...


# What an engine can do beyond the Engine protocol, declared by its class (`class VLLMEngine(StagedWake,
# GroupReceiver)`) and asked with isinstance, never probed method by method.


@runtime_checkable
class StagedWake(Protocol):
    """An engine that wakes in two steps around a weight sync (vLLM sleep mode): weights first (the
    sync writes into them), the KV cache after the trainer released its memory. `discard_weights`:
    keep no copy of the weights (a sync rewrites them all before the next generation)."""

    def sleep(self, discard_weights: bool = False) -> bool: ...

    def wake_weights(self) -> None: ...

    def wake_up(self) -> None: ...


@runtime_checkable
class GroupReceiver(Protocol):
    """An engine whose own worker process joins a sync group and loads what arrives (vLLM with a
    receiving worker extension): the buckets land where the weights live, not in the caller first.
    Other engines receive in their caller's process and `load_weights` (tirl.distributed.weight_sync)."""

    def join_sync_group(self, group: dict[str, Any], rank: int, address: str | None = None) -> None: ...

    def receive_sync(self) -> int: ...

    def leave_sync_group(self) -> None: ...


@runtime_checkable
class FlatLoader(Protocol):
    """An engine whose worker opens one packed sync without a copy (vLLM in this process tree,
    tirl.engines.handoff): a sync is packed once, in `dtype`, for every such engine; `near` says whether
    a buffer on that device is on the engine's own GPU (CUDA IPC) rather than a shared file's job."""

    dtype: torch.dtype

    def near(self, device: torch.device) -> bool: ...

    def load_flat(self, handoff: Any) -> None: ...


class EnginePool(Protocol):
    """Hands out an engine for one trajectory; all its turns stay on that engine (prefix-cache reuse).

    `group` names the prompt's rollout group (members prefer one engine: shared prompt prefix);
    `max_tokens` is the trajectory's maximum length L, which the KV-aware scheduler reserves.
    """

    def lease(self, group: str, max_tokens: int) -> AbstractAsyncContextManager[Engine]: ...


class SingleEnginePool:
    """The one-engine case: every trajectory runs on the same engine."""

    def __init__(self, engine: Engine):
        self.engine = engine

    @asynccontextmanager
    async def lease(self, group: str, max_tokens: int) -> AsyncIterator[Engine]:
        yield self.engine
