"""tirl.agent: tools, the tool protocol and the multi-turn loop that turns a problem into a trajectory.

Add a tool by subclassing `Tool` (see tirl.agent.tools) and naming it in `agent.tools`.
"""

from tirl.agent.config import AgentConfig
from tirl.agent.loop import InfraError, rollout, run_trajectory
from tirl.agent.protocol import (
    DEFAULT_SYSTEM_PROMPT,
    DEFAULT_USER_PROMPT,
    TOOL_NAME,
    TOOL_SCHEMA,
    ToolCall,
    ToolCallError,
    build_prompt_ids,
    build_prompt_text,
    count_answer_blocks,
    parse_tool_calls,
    render_tool_response,
    tool_response_text,
    truncate_middle,
)
from tirl.agent.tools import (
    BUILTIN_TOOLS,
    PythonSessionTool,
    PythonTool,
    Tool,
    ToolContext,
    ToolResult,
    ToolSpecError,
    resolve_tool,
)
from tirl.agent.trajectory import ToolCallRecord, Trajectory, tool_error_ratio
from tirl.sandbox.result import Executor
from tirl.seeds import derive_seed

__all__ = [
    "BUILTIN_TOOLS",
    "DEFAULT_SYSTEM_PROMPT",
    "DEFAULT_USER_PROMPT",
    "TOOL_NAME",
    "TOOL_SCHEMA",
    "AgentConfig",
    "Executor",
    "InfraError",
    "PythonSessionTool",
    "PythonTool",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolCallRecord",
    "ToolContext",
    "ToolResult",
    "ToolSpecError",
    "Trajectory",
    "build_prompt_ids",
    "build_prompt_text",
    "count_answer_blocks",
    "derive_seed",
    "parse_tool_calls",
    "render_tool_response",
    "resolve_tool",
    "rollout",
    "run_trajectory",
    "tool_error_ratio",
    "tool_response_text",
    "truncate_middle",
]
