"""Letting an asyncio event loop run what is ready, without waiting on time."""

from __future__ import annotations

import asyncio


async def settle(n: int = 20) -> None:
    """Yield to the event loop n times: every task that can move without I/O or a timer has moved."""
    for _ in range(n):
        await asyncio.sleep(0)
