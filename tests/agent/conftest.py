"""Fixtures for the agent tests: the real sandbox, the tiny model's tokenizer, a taught tiny model."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import pytest_asyncio
from tests.agent.scripted import COMPACT_SCHEMA, Script, call, record, teach, tool_call
from tests.conftest import cached_dir
from transformers import AutoModelForCausalLM

from tirl.agent import AgentConfig
from tirl.data.problem import Problem
from tirl.engines import EngineConfig, SingleEnginePool
from tirl.engines.hf import HFEngine

# Short prompt and schema keep the memorized conversations short (teaching cost grows with length).
CFG = AgentConfig(
    system_prompt="Use the tool.",
    user_prompt="{problem}",
    tool_schema=COMPACT_SCHEMA,
    use_chat_template=False,
    temperature=0.0,
    max_response_tokens=400,
    tool_timeout=5.0,
    show_exec_time=False,  # the taught model replays its script only on identical tool text
)
# The Python tool (shown with the compact schema) and a user tool loaded by its dotted path.
CFG_TWO_TOOLS = CFG.model_copy(
    update={
        "tools": ["execute_python_code_with_standard_io", "tests.agent.lookup_tool:Lookup"],
        # the Python tool shown as "py" with only `code`: short prompts teach fast
        "tool_schema": {
            "name": "py",
            "parameters": {"properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
        "max_calls_per_turn": 2,
        "stop_at_tool_call": False,  # both calls of a turn run (concurrently) when the turn ends
        "tool_output_max_chars": 64,  # the traceback's head and tail: short enough to teach quickly
    }
)
SLOW_S = 0.5  # the "mul" tool call sleeps this long (long enough to measure; every "mul" run waits it)
# A hang guard: only a hung loop reaches it. `make mutate` lowers it, so that a mutant that hangs is
# killed in a minute instead of five (the cached taught model answers in seconds).
HANG_S = float(os.environ.get("TIRL_TEST_HANG_S", "300"))
ANSWER = "</reason><answer>\\boxed{42}</answer><|im_end|>"

SCRIPTS = {
    # one slow tool call, then the answer
    "mul": Script(
        Problem("mul", "6*7?", "42"),
        [" go " + call(f"import time\ntime.sleep({SLOW_S})\nprint(6*7)"), ANSWER],
    ),
    # a malformed call (bad JSON), the error fed back, a corrected call with stdin, the answer
    "fix": Script(
        Problem("fix", "2*21?", "42"),
        [
            ' <tool_call>{"name": "execute_python_code_with_standard_io", "arguments": {"code": 1}}</tool_call>',
            " " + call("print(2*int(input()))", "21"),
            ANSWER,
        ],
    ),
    # the turn closes itself after the call (played with stop_at_tool_call=False)
    "closed": Script(Problem("closed", "5*8+2?", "42"), [" " + call("print(5*8+2)") + "<|im_end|>", ANSWER]),
    # calls the tool on every turn: ends by max_turns or by the budget
    "loop": Script(Problem("loop", "loop?", "0"), [" " + call("print(1)")] * 2),
    # two tools: a failing Python call and a failing lookup in one turn, both fixed in the next, the answer
    "two": Script(
        Problem("two", "6*7 by two tools?", "42"),
        [
            " "
            + tool_call("py", {"code": "print(6/0)"})
            + tool_call("lookup", {"key": "6*7"})
            + "<|im_end|>",
            " "
            + tool_call("py", {"code": "print(6*7)"})
            + tool_call("lookup", {"key": "six_times_seven"})
            + "<|im_end|>",
            ANSWER,
        ],
        CFG_TWO_TOOLS,
    ),
}


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def sandbox():
    from tirl.sandbox import Sandbox

    async with Sandbox(slots=4, preload=[]) as sb:
        yield sb


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def taught(tiny_model_dir, tokenizer, sandbox):
    """(model, recordings by script name): a tiny model that replays SCRIPTS under greedy decoding."""
    recordings = {name: await record(tokenizer, sandbox, s, CFG) for name, s in SCRIPTS.items()}

    def taught_model(out: Path | None = None):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        loss = teach(model, list(recordings.values()))
        assert loss < 0.05, f"the tiny model did not memorize the scripts (loss {loss:.3f})"
        if out is not None:
            model.save_pretrained(out)
        return model

    # `make mutate` keeps the taught weights per (base model, recordings, teaching code)
    key = f"{tiny_model_dir}{recordings}{inspect.getsource(teach)}"
    cached = cached_dir("taught", key, taught_model)
    model = taught_model() if cached is None else AutoModelForCausalLM.from_pretrained(cached)
    return model, recordings


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def engine(taught, tiny_model_dir, tokenizer):
    model, _ = taught
    eng = HFEngine(EngineConfig(model=str(tiny_model_dir), device="cpu"), model=model, tokenizer=tokenizer)
    yield eng
    await eng.close()


@pytest.fixture
def pool(engine):
    return SingleEnginePool(engine)


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def random_engine(tiny_model_dir):
    """The untaught tiny model: random text, never a tool call."""
    eng = HFEngine(EngineConfig(model=str(tiny_model_dir), device="cpu"))
    yield eng
    await eng.close()
