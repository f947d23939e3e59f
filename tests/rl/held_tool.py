"""A user tool for the async tests (`tests.rl.held_tool:Hold`): its call waits until the test releases
it, so a weight sync can land between two turns of one trajectory (a partial rollout)."""

from __future__ import annotations

import asyncio
from typing import ClassVar

from tirl.agent.tools import Tool, ToolResult


class Hold(Tool):
    name = "hold"
    entered: ClassVar[asyncio.Event | None] = None  # set when a call starts
    release: ClassVar[asyncio.Event | None] = None  # the call returns once this is set

    async def call(self, arguments: dict) -> ToolResult:
        Hold.entered.set()
        await Hold.release.wait()
        return ToolResult("released")
