"""A small user tool for the tests, loaded by its dotted path `tests.agent.lookup_tool:Lookup`."""

from __future__ import annotations

from typing import ClassVar

from tirl.agent.tools import Tool, ToolResult

TABLE = {"six_times_seven": "42"}


class Lookup(Tool):
    name = "lookup"  # no description: a short schema keeps the taught conversation short
    parameters: ClassVar[dict] = {
        "type": "object",
        "properties": {"key": {"type": "string"}},
        "required": ["key"],
    }
    closed: ClassVar[list[Lookup]] = []  # instances whose close() ran (the lifecycle test reads it)

    def __init__(self, context) -> None:
        super().__init__(context)
        self.calls = 0  # per-trajectory state

    async def call(self, arguments: dict) -> ToolResult:
        self.calls += 1
        key = arguments["key"]
        if key not in TABLE:
            return ToolResult(f"no entry {key!r}", status="runtime_error")
        return ToolResult(TABLE[key])

    async def close(self) -> None:
        Lookup.closed.append(self)


class NotATool:
    name = "not_a_tool"


class BadSchema(Lookup):
    name = "bad_schema"
    parameters: ClassVar[dict] = {"type": "object", "properties": {"key": {"type": "text"}}}


class Unnamed(Lookup):
    name = ""


class FailsToClose(Lookup):
    """A lookup whose clean-up fails (the loop must log it and keep the trajectory)."""

    async def close(self) -> None:
        raise RuntimeError("lookup table is gone")
