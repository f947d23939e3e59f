"""The `local` runtime (the default): engines in this process, a `tirl sandbox serve` child process
(or the configured remote services), math-verify worker processes. Nothing to install."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING

from tirl.runtime.base import Runtime

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tirl.engines.config import EngineConfig
    from tirl.reward import RewardConfig
    from tirl.runtime.config import ClusterConfig
    from tirl.sandbox import SandboxConfig


@asynccontextmanager
async def open_local_runtime(
    cluster: ClusterConfig,
    engine: EngineConfig,
    sandbox: SandboxConfig,
    reward: RewardConfig | None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> AsyncIterator[Runtime]:
    from tirl.engines.factory import build_engines, build_pool
    from tirl.engines.tokenizer import load_tokenizer
    from tirl.reward import RewardPool
    from tirl.sandbox import open_executor

    tokenizer = tokenizer or load_tokenizer(engine.model)
    engines = build_engines(engine)
    try:
        async with AsyncExitStack() as stack:
            executor = await stack.enter_async_context(open_executor(sandbox))
            scorer = await stack.enter_async_context(RewardPool(reward)) if reward is not None else None
            yield Runtime(engines, build_pool(engines, engine), executor, scorer, tokenizer)
    finally:
        await asyncio.gather(*(e.close() for e in engines), return_exceptions=True)
