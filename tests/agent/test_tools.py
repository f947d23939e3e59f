"""The Tool seam: several tools in one trajectory, a user tool by dotted path, clear errors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from tests.agent.conftest import CFG_TWO_TOOLS, SCRIPTS
from tests.agent.lookup_tool import Lookup

from tirl.agent import AgentConfig, PythonTool, ToolSpecError, parse_tool_calls, resolve_tool, run_trajectory
from tirl.agent.protocol import ToolCall, ToolCallError, build_prompt_text, tool_schemas
from tirl.rl.metrics import rollout_metrics
from tirl.rl.roc import penalties

session_loop = pytest.mark.asyncio(loop_scope="session")


@session_loop
async def test_two_tools_in_one_trajectory_and_roc_counts_each_tools_errors(pool, tokenizer, sandbox, taught):
    _, recordings = taught
    events: list[tuple[str, dict]] = []
    traj = await run_trajectory(
        pool,
        tokenizer,
        sandbox,
        SCRIPTS["two"].problem,
        CFG_TWO_TOOLS,
        group="two",
        on_event=lambda k, p: events.append((k, p)),
    )
    rec = recordings["two"]
    assert (traj.finish_reason, traj.turns, traj.error) == ("answered", 3, "")
    assert traj.response_ids == rec.response_ids and traj.loss_mask == rec.loss_mask
    calls = [(c.turn, c.tool, c.status) for c in traj.tool_calls]
    assert sorted(calls) == [
        (0, "lookup", "runtime_error"),
        (0, "py", "runtime_error"),
        (1, "lookup", "ok"),
        (1, "py", "ok"),
    ]
    results = {(p["turn"], p["tool"]): p["text"] for k, p in events if k == "tool_result"}
    assert results[(0, "py")].startswith("Traceback") and results[(0, "py")].endswith("[runtime_error]")
    assert results[(0, "lookup")].startswith("no entry '6*7'")
    assert results[(1, "lookup")] == "42" and results[(1, "py")] == "42\n[ok]"
    # RoC's p_err pools the errors of every tool: 2 errored calls of 4
    assert (traj.num_tool_calls, traj.num_tool_errors) == (4, 2)
    assert penalties(traj).p_err == 0.5
    m = rollout_metrics([[traj]], [[0]], no_tool_p_err=0.5)
    assert m["tools/lookup/calls"] == 2 and m["tools/lookup/error_ratio"] == 0.5
    assert m["tools/py/error_ratio"] == 0.5


@session_loop
async def test_each_trajectory_gets_its_own_tool_instance_closed_at_the_end(pool, tokenizer, sandbox, taught):
    Lookup.closed.clear()
    for _ in range(2):
        await run_trajectory(pool, tokenizer, sandbox, SCRIPTS["two"].problem, CFG_TWO_TOOLS, group="two")
    assert len(Lookup.closed) == 2 and Lookup.closed[0] is not Lookup.closed[1]
    assert [t.calls for t in Lookup.closed] == [2, 2]


def test_all_schemas_in_the_prompt_and_calls_checked_against_the_named_tool(tokenizer):
    text = build_prompt_text(tokenizer, "P", CFG_TWO_TOOLS)
    tools_block = text[text.index("<tools>") : text.index("</tools>")]
    assert '"name": "py"' in tools_block and '"name": "lookup"' in tools_block
    schemas = tool_schemas(CFG_TWO_TOOLS)
    ok, wrong_arg, unknown = parse_tool_calls(
        '<tool_call>{"name": "lookup", "arguments": {"key": "k"}}</tool_call>'
        '<tool_call>{"name": "lookup", "arguments": {"code": "1"}}</tool_call>'
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>',
        tools=schemas,
    )
    assert isinstance(ok, ToolCall) and ok.arguments == {"key": "k"}
    assert (
        isinstance(wrong_arg, ToolCallError)
        and wrong_arg.message == "missing required argument(s) 'key' for lookup"
    )
    assert unknown.message == "unknown tool 'search': the tools are 'py', 'lookup'"


def test_user_tool_from_a_dotted_path():
    assert resolve_tool("tests.agent.lookup_tool:Lookup") is Lookup
    assert resolve_tool("execute_python_code_with_standard_io") is PythonTool
    cfg = AgentConfig(tools=["tests.agent.lookup_tool:Lookup"])
    assert [s["function"]["name"] for s in tool_schemas(cfg)] == ["lookup"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "search",
            "unknown tool 'search': use one of execute_python_code_with_standard_io, python_session or a path",
        ),
        ("nopkg.tools:Search", "cannot import module 'nopkg.tools'"),
        ("tests.agent.lookup_tool:Search", "module 'tests.agent.lookup_tool' has no attribute 'Search'"),
        ("tests.agent.lookup_tool:NotATool", "is not a tirl.agent.tools.Tool subclass"),
        ("tests.agent.lookup_tool:BadSchema", "argument 'key' has unknown type 'text'"),
        ("tests.agent.lookup_tool:Unnamed", "the schema needs a non-empty string 'name'"),
    ],
)
def test_bad_tool_path_or_schema_is_a_clear_error_at_config_load(spec, message):
    with pytest.raises(ValidationError) as err:
        AgentConfig(tools=[spec])
    assert message in str(err.value)
    with pytest.raises(ToolSpecError):
        resolve_tool(spec)


def test_duplicate_names_and_a_bad_schema_override_are_rejected():
    with pytest.raises(ValidationError, match="two tools are named 'lookup'"):
        AgentConfig(tools=["tests.agent.lookup_tool:Lookup", "tests.agent.lookup_tool:Lookup"])
    bad = {"name": "py", "parameters": {"properties": {}, "required": ["code"]}}
    with pytest.raises(ValidationError, match="'required' must list declared properties"):
        AgentConfig(tool_schema=bad)
    with pytest.raises(ValidationError, match=r"agent\.tools is empty"):
        AgentConfig(tools=[])


def test_repr_addresses_are_numbered_by_first_appearance_and_computed_hex_stays():
    from tirl.agent.tools import stable_addresses

    text = "<f at 0x7f3a12345678> <generator object <genexpr> at 0x55d03cfdf2a0> <f at 0x7f3a12345678> 0x10000000000"
    assert stable_addresses(text) == (
        "<f at 0x#1> <generator object <genexpr> at 0x#2> <f at 0x#1> 0x10000000000"
    )


async def test_the_python_tool_answers_the_same_in_two_fresh_sandboxes():
    """Two runs with one seed must show the model the same tokens: a printed set of strings (ordered by
    the interpreter's string hash) and an object's repr (its address) differ between processes unless
    the sandbox fixes the hash and the tool numbers the addresses (run times are off, as in the demo)."""
    from tirl.agent.tools import ToolContext
    from tirl.sandbox import Sandbox

    code = "print({'apple', 'pear', 'plum', 'fig', 'kiwi', 'lime'})\nprint(x for x in [])\nprint(hex(2**40))"
    answers = []
    for _ in range(2):  # a fresh pool each time: its own zygote, hash secret and address space
        async with Sandbox(slots=1, preload=[]) as sb:
            tool = PythonTool(ToolContext(sb, AgentConfig(show_exec_time=False)))
            answers.append((await tool.call({"code": code})).text)
    assert answers[0] == answers[1], answers
    assert "at 0x#1>" in answers[0] and "0x10000000000" in answers[0]
