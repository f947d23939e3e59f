"""The persistent Python session as a built-in tool: state across calls, loss, and nothing left behind."""

from __future__ import annotations

import pytest

from tirl.agent import AgentConfig, PythonSessionTool, ToolContext, ToolSpecError, resolve_tool
from tirl.agent.tools import toolbox

session_loop = pytest.mark.asyncio(loop_scope="session")
CFG = AgentConfig(tools=["execute_python_code_with_standard_io", "python_session"], tool_timeout=5.0)


@session_loop
async def test_state_survives_three_calls_and_is_gone_after_close(sandbox):
    tools = toolbox(CFG.tools).open(ToolContext(sandbox, CFG))
    assert set(tools) == {"execute_python_code_with_standard_io", "python_session"}
    session = tools["python_session"]
    first = await session.call({"code": "import math\nx = 6"})
    second = await session.call({"code": "def f(y):\n    return x * y + math.factorial(3)"})
    third = await session.call({"code": "print(f(int(input())))", "input": "7"})
    assert [r.status for r in (first, second, third)] == ["ok", "ok", "ok"]
    assert third.text.startswith("48")
    # the stateless tool in the same trajectory never sees the session's names
    stateless = await tools["execute_python_code_with_standard_io"].call({"code": "print(x)"})
    assert stateless.status == "runtime_error" and "NameError" in stateless.text
    live = dict(sandbox.sessions.live)
    assert len(live) == 1
    await session.close()
    assert sandbox.sessions.live == {}


@session_loop
async def test_a_lost_session_says_so_and_the_next_call_starts_fresh(sandbox):
    tool = PythonSessionTool(ToolContext(sandbox, AgentConfig(tool_timeout=1.0)))
    await tool.call({"code": "kept = 1"})
    lost = await tool.call({"code": "while True:\n    pass"})
    assert lost.status == "timeout" and "session" in lost.text
    fresh = await tool.call({"code": "print(kept)"})
    assert fresh.status == "runtime_error" and "NameError" in fresh.text
    await tool.close()
    assert sandbox.sessions.live == {}


@session_loop
async def test_needs_an_executor_that_opens_sessions():
    class RunOnly:
        async def run(self, code: str, stdin: str = "", timeout: float | None = None): ...

    assert resolve_tool("python_session") is PythonSessionTool
    with pytest.raises(ToolSpecError, match="needs an executor with open_session"):
        await PythonSessionTool(ToolContext(RunOnly(), CFG)).call({"code": "1"})
