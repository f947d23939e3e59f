"""Tools the model can call: the `Tool` interface, the built-in tools, and the registry configs name.

A tool is a class with a name, a JSON schema for its arguments and an async `call`:

    from tirl.agent.tools import Tool, ToolResult

    class Search(Tool):
        name = "search"
        description = "Look a term up in the local encyclopedia."
        parameters = {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "what to look up"}},
            "required": ["query"],
        }

        async def call(self, arguments: dict) -> ToolResult:
            hits = my_index.lookup(arguments["query"])
            if not hits:
                return ToolResult("no entry found", status="runtime_error")  # counts as an error for RoC
            return ToolResult("\\n".join(hits))

and the agent config names it: `agent.tools: [execute_python_code_with_standard_io, mypkg.tools:Search]`
(a built-in name from `BUILTIN_TOOLS`, or `module:Class`). Its schema goes into the prompt's
`<tools>` block next to the others, and the parser checks every call against the schema of the tool
it names before `call` runs, so `arguments` always has the required keys with the declared JSON types.

Lifecycle: one instance per trajectory (`Tool(context)`), closed with `close()` when the trajectory
ends, so a stateful tool (a persistent Python session) keeps its state in `self` and releases it in
`close`. `context.executor` is the trajectory's sandbox (Sandbox or SandboxClient); `context.cfg` is
the agent config (timeouts, output display).

The status of a result is what RoC and the metrics read (tirl.agent.trajectory.ToolCallStatus):
"ok" is clean; "runtime_error", "timeout", "malformed" and "other_error" count as the model's errors
(RoC's p_err); "sandbox_error" means the tool's infrastructure failed: the trajectory ends with
finish reason "error" and is never scored, because it says nothing about the policy.
"""

from __future__ import annotations

import functools
import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from tirl.agent.trajectory import ToolCallStatus
from tirl.plugins import PluginError, resolve
from tirl.sandbox.addresses import stable_addresses
from tirl.sandbox.result import ExecResult, Executor, Status


class Session(Protocol):
    """A live Python session (tirl.sandbox's local Session or HTTP RemoteSession)."""

    async def run(self, code: str, stdin: str = "", timeout: float | None = None) -> ExecResult: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class SessionExecutor(Protocol):
    """An executor that can also open persistent sessions (Sandbox, SandboxClient)."""

    async def open_session(self) -> Session: ...


class ToolSpecError(ValueError):
    """A tool named in the config cannot be loaded, or its schema is invalid."""


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model sees inside <tool_response> (the loop truncates long text in the middle)
    status: ToolCallStatus = "ok"
    wall_ms: float = 0.0  # time the tool itself took (for the metrics)


class ToolSettings(Protocol):
    """The agent settings the built-in tools read; the loop passes its whole AgentConfig
    (tirl.agent.config, which lists the tools and so sits above this module)."""

    tool_timeout: float
    show_exec_time: bool


@dataclass(frozen=True)
class ToolContext:
    """What a tool may use: the trajectory's sandbox executor and the agent config."""

    executor: Executor | None
    cfg: ToolSettings


class Tool(ABC):
    """One tool the model can call; subclass it and set name, description and parameters."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    parameters: ClassVar[dict] = {"type": "object", "properties": {}}  # JSON schema of the arguments

    def __init__(self, context: ToolContext) -> None:
        self.context = context

    @classmethod
    def schema(cls) -> dict:
        """The OpenAI-style function schema shown to the model in <tools>."""
        fn = {"name": cls.name, "description": cls.description, "parameters": cls.parameters}
        return {"type": "function", "function": {k: v for k, v in fn.items() if v != ""}}

    @abstractmethod
    async def call(self, arguments: dict) -> ToolResult:
        """Run one call whose arguments already match `parameters`."""

    async def close(self) -> None:
        """Release what this trajectory's instance holds (called once, when the trajectory ends)."""
        return None


_EXEC_STATUS: dict[Status, ToolCallStatus] = {Status.OK: "ok", Status.TIMEOUT: "timeout"}


def exec_status(result: ExecResult) -> ToolCallStatus:
    """The tool-call status of a sandbox result (infrastructure failures are not the model's)."""
    if result.is_infra_error:
        return "sandbox_error"
    return _EXEC_STATUS.get(result.status, "runtime_error")


class PythonTool(Tool):
    """The paper's stateless Python tool: every call runs `code` with `input` as stdin in a fresh
    interpreter in the sandbox and returns what it printed (or the last expression's value, the
    error and traceback, or a time-out notice)."""

    name = "execute_python_code_with_standard_io"
    description = (
        "Run Python 3 code with the given standard input and return what it prints. When nothing is "
        "printed, the value of the last expression is returned; on failure, the error and traceback; "
        "on a time-out, a notice. Every call starts a fresh interpreter: define what you use. "
        "numpy, sympy and scipy are installed."
    )
    parameters: ClassVar[dict] = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "The Python source code to run."},
            "input": {"type": "string", "description": "Text passed to the program as standard input."},
        },
        "required": ["code"],
    }

    async def call(self, arguments: dict) -> ToolResult:
        cfg, executor = self.context.cfg, self.context.executor
        if executor is None:
            raise ToolSpecError(f"the {self.name} tool needs a sandbox executor; none was given")
        result = await executor.run(arguments.get("code", ""), arguments.get("input", ""), cfg.tool_timeout)
        return exec_tool_result(result, cfg.show_exec_time)


def exec_tool_result(result: ExecResult, show_time: bool) -> ToolResult:
    """What a Python tool answers for one sandbox result."""
    status = exec_status(result)
    if status == "sandbox_error":  # the loop reports it, the model never sees it
        text = f"{result.status}: {result.message or result.stderr}"
    else:
        # only the object addresses the program's own process reported (a computed hex stays)
        text = stable_addresses(result.render(show_time=show_time), result.extra.get("addresses"))
    return ToolResult(text, status, result.wall_ms)


class PythonSessionTool(Tool):
    """A persistent Python session per trajectory: what one call defines (variables, imports,
    functions) is there in the next. Not the paper's tool (its stateless one stays the default).

    One live interpreter in the sandbox (same isolation and limits as a call), opened on the first
    call and closed with the trajectory; the paper release instead replays earlier cells, whose cost
    grows with the square of the number of calls. A session killed (time-out, memory) says so to the
    model, which then starts over in a fresh one; a session that cannot be opened at all (the
    server's cap, no free slot) is an infrastructure failure, not the model's.
    """

    name = "python_session"
    description = (
        "Run Python 3 code in a persistent session and return what it prints. Variables, imports and "
        "functions defined in earlier calls stay defined. When nothing is printed, the value of the "
        "last expression is returned; on failure, the error and traceback. numpy, sympy and scipy "
        "are installed."
    )
    parameters: ClassVar[dict] = PythonTool.parameters

    def __init__(self, context: ToolContext) -> None:
        super().__init__(context)
        self._session: Session | None = None

    async def call(self, arguments: dict) -> ToolResult:
        cfg, executor = self.context.cfg, self.context.executor
        if not isinstance(executor, SessionExecutor):
            raise ToolSpecError(
                f"the {self.name} tool needs an executor with open_session() (tirl.sandbox.Sandbox or "
                f"SandboxClient); got {type(executor).__name__}"
            )
        if self._session is None:
            try:
                self._session = await executor.open_session()
            except Exception as exc:  # a full server or a dead endpoint: infrastructure
                return ToolResult(f"sandbox_error: could not open a Python session: {exc}", "sandbox_error")
        result = await self._session.run(
            arguments.get("code", ""), arguments.get("input", ""), cfg.tool_timeout
        )
        if result.extra.get("session_lost"):  # its message tells the model; the next call opens a fresh one
            await self.close()  # release what the dead session still holds (uid, cgroup) now
        return exec_tool_result(result, cfg.show_exec_time)

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.aclose()


BUILTIN_TOOLS: dict[str, type[Tool]] = {
    PythonTool.name: PythonTool,
    PythonSessionTool.name: PythonSessionTool,
}
DEFAULT_TOOLS: tuple[str, ...] = (PythonTool.name,)

_JSON_TYPES = ("string", "integer", "number", "boolean", "object", "array", "null")


@functools.cache
def resolve_tool(spec: str) -> type[Tool]:
    """A built-in tool's class by name, or a user's by dotted path `package.module:Class`."""
    try:
        cls = resolve("tool", BUILTIN_TOOLS, spec)
    except PluginError as exc:
        raise ToolSpecError(str(exc)) from exc
    if not (inspect.isclass(cls) and issubclass(cls, Tool)) or inspect.isabstract(cls):
        raise ToolSpecError(
            f"tool {spec!r} is not a tirl.agent.tools.Tool subclass with an async call(arguments) method"
        )
    check_schema(cls.schema(), f"tool {spec!r}")
    return cls


def check_schema(schema: dict, where: str) -> None:
    """Raise ToolSpecError unless `schema` is a function schema the parser can check calls against."""
    fn = schema.get("function", schema) if isinstance(schema, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolSpecError(f"{where}: the schema needs a non-empty string 'name'")
    params = fn.get("parameters", {})
    props = params.get("properties", {}) if isinstance(params, dict) else None
    if not isinstance(props, dict):
        raise ToolSpecError(f"{where}: 'parameters' must be a JSON schema object with a 'properties' object")
    for key, prop in props.items():
        kind = prop.get("type") if isinstance(prop, dict) else None
        if kind is not None and kind not in _JSON_TYPES:
            raise ToolSpecError(
                f"{where}: argument {key!r} has unknown type {kind!r} (use one of {', '.join(_JSON_TYPES)})"
            )
    required = params.get("required", [])
    missing = [r for r in required if r not in props] if isinstance(required, list) else None
    if missing is None or missing:
        raise ToolSpecError(f"{where}: 'required' must list declared properties, got {required!r}")
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise ToolSpecError(f"{where}: the schema is not JSON-serializable ({exc})") from exc


def schema_name(schema: dict) -> str:
    return schema.get("function", schema)["name"]


@dataclass(frozen=True)
class Toolbox:
    """The tools of one agent config: the schemas the model sees, and the class behind each name."""

    schemas: tuple[dict, ...]
    classes: dict[str, type[Tool]]  # the name the model calls -> its class

    def open(self, context: ToolContext) -> dict[str, Tool]:
        """Fresh instances for one trajectory (close them with close_tools)."""
        return {name: cls(context) for name, cls in self.classes.items()}


def toolbox(specs: Sequence[str], schema_override: dict | None = None) -> Toolbox:
    """Resolve and check the configured tools. `schema_override` replaces the FIRST tool's schema as
    the model sees it (a shorter description, a different name, fewer optional arguments)."""
    if not specs:
        raise ToolSpecError(
            "agent.tools is empty: name at least one tool (e.g. execute_python_code_with_standard_io)"
        )
    classes = [resolve_tool(s) for s in specs]
    schemas = [c.schema() for c in classes]
    if schema_override is not None:
        check_schema(schema_override, "agent.tool_schema")
        schemas[0] = schema_override
    names = [schema_name(s) for s in schemas]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ToolSpecError(
            f"agent.tools: two tools are named {', '.join(map(repr, dupes))}; names must differ"
        )
    return Toolbox(tuple(schemas), dict(zip(names, classes, strict=True)))


async def close_tools(tools: dict[str, Tool]) -> None:
    for tool in tools.values():
        await tool.close()
