"""The tool protocol's parser and renderers pinned exactly (tirl.agent.protocol): every error message
the model reads, each JSON Schema type (a boolean is not an integer, an integer is a number), spans,
the per-turn limit, the tool-response segment, the built-in ChatML layout, and the context check at
its boundary, with a character-level fake tokenizer (no model); see docs/mutation.md."""

from __future__ import annotations

import json

import pytest

from tirl.agent import AgentConfig
from tirl.agent.protocol import (
    DEFAULT_SYSTEM_PROMPT,
    DEFAULT_USER_PROMPT,
    TOOL_NAME,
    TOOL_SCHEMA,
    ToolCall,
    ToolCallError,
    build_prompt_ids,
    build_prompt_text,
    check_context,
    count_answer_blocks,
    longest_prompt,
    parse_tool_calls,
    render_tool_response,
    supports_tools,
    tool_response_text,
    tool_schemas,
    truncate_middle,
)
from tirl.config import ConfigError
from tirl.data.problem import Problem

NAME = "execute_python_code_with_standard_io"


def wrap(obj) -> str:
    body = obj if isinstance(obj, str) else json.dumps(obj)
    return f"<tool_call>{body}</tool_call>"


def only_error(text: str, **kw) -> ToolCallError:
    [r] = parse_tool_calls(text, **kw)
    assert isinstance(r, ToolCallError), r
    return r


TYPED = {
    "type": "function",
    "function": {
        "name": "typed",
        "parameters": {
            "properties": {
                "s": {"type": "string"},
                "i": {"type": "integer"},
                "n": {"type": "number"},
                "b": {"type": "boolean"},
                "o": {"type": "object"},
                "a": {"type": "array"},
                "z": {"type": "null"},
                "any": {},
                "odd": {"type": "tuple"},
            },
            "required": ["s"],
        },
    },
}


@pytest.mark.parametrize(
    ("key", "value", "ok"),
    [
        ("i", 3, True),
        ("i", True, False),
        ("i", 3.5, False),
        ("i", "3", False),
        ("n", 3, True),
        ("n", 2.5, True),
        ("n", False, False),
        ("n", "1", False),
        ("b", True, True),
        ("b", 1, False),
        ("b", None, False),
        ("o", {}, True),
        ("o", [], False),
        ("a", [1], True),
        ("a", {}, False),
        ("z", None, True),
        ("z", 0, False),
        ("s", "x", True),
        ("s", 1, False),
        ("s", True, False),
        ("any", [True], True),
        ("odd", True, True),
    ],
)
def test_argument_types_follow_json_schema(key, value, ok):
    args = {"s": "x", key: value}
    [r] = parse_tool_calls(wrap({"name": "typed", "arguments": args}), tools=TYPED)
    if ok:
        assert isinstance(r, ToolCall) and r.arguments == args
    else:
        assert isinstance(r, ToolCallError)
        assert r.message.startswith(f"argument {key!r} must be a JSON ")


@pytest.mark.parametrize(
    ("value", "name"),
    [
        (None, "null"),
        (True, "boolean"),
        (False, "boolean"),
        (3, "number"),
        (2.5, "number"),
        ("x", "string"),
        ([1], "array"),
        ({"a": 1}, "object"),
    ],
)
def test_wrong_types_are_named_in_json_terms(value, name):
    err = only_error(wrap({"name": NAME, "arguments": value}))
    if name == "object":
        return  # an object is the right type for "arguments"
    assert err.message == f'"arguments" must be a JSON object, got a JSON {name}'
    err = only_error(f"<tool_call>{json.dumps(value)}</tool_call>")
    assert err.message == f'a tool call must be a JSON object with "name" and "arguments", got a JSON {name}'


def test_a_boolean_argument_for_an_integer_is_reported_as_a_boolean():
    err = only_error(wrap({"name": "typed", "arguments": {"s": "x", "i": True}}), tools=TYPED)
    assert err.message == "argument 'i' must be a JSON integer, got a JSON boolean"
    err = only_error(wrap({"name": "typed", "arguments": {"s": "x", "b": 0}}), tools=TYPED)
    assert err.message == "argument 'b' must be a JSON boolean, got a JSON number"


def test_every_error_message_in_full():
    cases = [
        (
            "<tool_call> \n </tool_call>",
            'empty tool call: put a JSON object {"name": ..., "arguments": {...}} inside <tool_call>',
        ),
        (
            '<tool_call>{"name": 1</tool_call>',
            "invalid JSON in tool call: Expecting ',' delimiter at line 1 column 11",
        ),
        ("<tool_call>\n{}\n{}</tool_call>", "unexpected text after the JSON object in tool call: '{}'"),
        (
            wrap({"name": NAME, "arguments": {}, "b": 1, "a": 2}),
            "unexpected key(s) 'a', 'b' in tool call: only \"name\" and \"arguments\"",
        ),
        (wrap({"arguments": {}}), 'tool call has no "name"'),
        (wrap({"name": "sh", "arguments": {}}), f"unknown tool 'sh': the only tool is {NAME!r}"),
        (wrap({"name": NAME}), 'tool call has no "arguments" object'),
        (
            wrap({"name": NAME, "arguments": {"input": "1"}}),
            f"missing required argument(s) 'code' for {NAME}",
        ),
        (
            wrap({"name": NAME, "arguments": {"code": "1", "z": 1, "y": 2}}),
            f"unexpected argument(s) 'y', 'z' for {NAME} (allowed: 'code', 'input')",
        ),
        (
            "<answer>" + wrap({"name": NAME, "arguments": {"code": "1"}}),
            "tool call inside <answer>: call tools before answering, the answer must be final",
        ),
    ]
    for text, message in cases:
        err = only_error(text)
        assert err.message == message, text
        assert err.render() == f"Error: {message}"


def test_extra_text_after_the_json_is_cut_to_40_characters():
    err = only_error("<tool_call>{} " + "x" * 50 + "</tool_call>")
    assert err.message == f"unexpected text after the JSON object in tool call: {'x' * 40!r}"


def test_several_tools_are_listed_when_the_name_is_unknown():
    other = {"type": "function", "function": {"name": "calc", "parameters": {"properties": {}}}}
    err = only_error(wrap({"name": "sh", "arguments": {}}), tools=[TOOL_SCHEMA, other])
    assert err.message == f"unknown tool 'sh': the tools are {NAME!r}, 'calc'"
    [ok] = parse_tool_calls(wrap({"name": "calc", "arguments": {}}), tools=[TOOL_SCHEMA, other])
    assert isinstance(ok, ToolCall) and ok.name == "calc"
    # a bare function schema (no "function" wrapper) names its tool too
    bare = {"name": "bare", "parameters": {"properties": {"q": {"type": "string"}}, "required": ["q"]}}
    [ok] = parse_tool_calls(wrap({"name": "bare", "arguments": {"q": "1"}}), tools=bare)
    assert isinstance(ok, ToolCall)
    assert only_error(wrap({"name": "bare", "arguments": {}}), tools=bare).message == (
        "missing required argument(s) 'q' for bare"
    )
    nothing = {"name": "nothing"}  # no parameters: no argument allowed, none required
    [ok] = parse_tool_calls(wrap({"name": "nothing", "arguments": {}}), tools=nothing)
    assert isinstance(ok, ToolCall)


def test_spans_and_raw_text_of_calls_and_errors():
    good = wrap({"name": NAME, "arguments": {"code": "1"}})
    text = "ab" + good + "cd<tool_call> [1] </tool_call>"
    first, second = parse_tool_calls(text)
    assert isinstance(first, ToolCall) and (first.start, first.end) == (2, 2 + len(good))
    assert isinstance(second, ToolCallError) and second.raw == " [1] "
    assert (second.start, second.end) == (len("ab" + good + "cd"), len(text))
    [orphan] = parse_tool_calls("xy</tool_call>")
    assert (orphan.message, orphan.raw, orphan.start, orphan.end) == (
        "found </tool_call> without a matching <tool_call>",
        "",
        2,
        len("xy</tool_call>"),
    )
    [unclosed] = parse_tool_calls("xy<tool_call>{")
    assert (unclosed.raw, unclosed.start, unclosed.end) == ("<tool_call>{", 2, len("xy<tool_call>{"))
    assert unclosed.message == "unclosed <tool_call>: end the call with </tool_call>"
    reopened, closed = parse_tool_calls("<tool_call>a<tool_call>" + good[len("<tool_call>") :])
    assert (reopened.raw, reopened.start, reopened.end) == ("<tool_call>a", 0, len("<tool_call>a"))
    assert reopened.message == "<tool_call> opened again before the previous one was closed with </tool_call>"
    assert isinstance(closed, ToolCall)


def test_a_call_after_answers_that_all_closed_is_allowed():
    good = wrap({"name": NAME, "arguments": {"code": "1"}})
    [ok] = parse_tool_calls("<answer>1</answer> <answer>2</answer>" + good)
    assert isinstance(ok, ToolCall)
    err = only_error("<answer>1</answer> <answer>2" + good)
    assert err.message.startswith("tool call inside <answer>")


def test_the_per_turn_limit_keeps_spans_and_counts_from_one():
    good = wrap({"name": NAME, "arguments": {"code": "1"}})
    text = good + "<tool_call>[]</tool_call>" + good
    results = parse_tool_calls(text, max_calls=1)
    assert isinstance(results[0], ToolCall)
    for n, r in enumerate(results[1:], start=2):
        assert r.message == (
            f"only 1 tool call(s) per turn are executed; call #{n} was skipped: "
            "make one call, read its result, then continue"
        )
        assert r.raw == ""
    assert (results[1].start, results[1].end) == (len(good), len(good) + len("<tool_call>[]</tool_call>"))
    assert (results[2].start, results[2].end) == (len(text) - len(good), len(text))
    assert [type(r) for r in parse_tool_calls(text, max_calls=0)] == [ToolCallError] * 3
    assert [type(r) for r in parse_tool_calls(text, max_calls=3)] == [ToolCall, ToolCallError, ToolCall]


def test_answer_blocks_count_openings():
    assert count_answer_blocks("<answer>1") == 1 and count_answer_blocks("</answer>") == 0


def test_truncate_middle_exact_layout():
    assert truncate_middle("abcdef", 6) == "abcdef"
    assert truncate_middle("abcdefg", 4) == "ab\n... [3 characters omitted] ...\nfg"
    assert truncate_middle("abcdefgh", 5) == "ab\n... [4 characters omitted] ...\ngh"


def test_tool_response_segment_exact_text():
    cfg = AgentConfig(prefill="<reason>")
    assert tool_response_text(["1", "2"], cfg, turn_closed=False) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n<reason>"
    )
    cont = AgentConfig(prefill="<reason>", continue_prefill="")
    assert tool_response_text(["x"], cont, turn_closed=True) == (
        "\n<|im_start|>user\n<tool_response>\nx\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


class CharTokenizer:
    """One token per character; a chat template that mentions tools (or not)."""

    def __init__(self, template: str | None = None):
        self.chat_template = template
        self.calls: list[dict] = []

    def __call__(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages, **kw):
        self.calls.append({"messages": messages, **kw})
        return "T:" + "|".join(m["content"] for m in messages)


def test_supports_tools_reads_the_template():
    assert supports_tools(CharTokenizer("{% if tools %}"))
    assert not supports_tools(CharTokenizer("plain"))
    assert not supports_tools(CharTokenizer(None))
    assert not supports_tools(object())


def test_a_template_with_tools_renders_the_prompt():
    tok = CharTokenizer("... tools ...")
    cfg = AgentConfig(system_prompt="S", user_prompt="U {problem}", prefill="<p>")
    assert build_prompt_text(tok, "Q", cfg) == "T:S|U Q<p>"
    [c] = tok.calls
    assert c["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "U Q"}]
    assert c["tools"] == list(tool_schemas(cfg)) == [TOOL_SCHEMA]
    assert c["add_generation_prompt"] is True and c["tokenize"] is False
    assert build_prompt_ids(tok, "Q", cfg) == [ord(ch) for ch in "T:S|U Q<p>"]


def test_the_builtin_chatml_layout():
    tok = CharTokenizer("... tools ...")
    cfg = AgentConfig(use_chat_template=False, system_prompt="", prefill="")
    lines = json.dumps(TOOL_SCHEMA, ensure_ascii=False)
    assert build_prompt_text(tok, "Q", cfg) == (
        f"<|im_start|>system\n\n\n# Tools\n<tools>\n{lines}\n</tools><|im_end|>\n"
        f"<|im_start|>user\n{DEFAULT_USER_PROMPT.format(problem='Q')}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.calls == []
    plain = CharTokenizer("no t-o-o-l-s here")
    assert build_prompt_text(plain, "Q", AgentConfig()).startswith(
        f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}"
    )
    assert build_prompt_text(plain, "Q", AgentConfig()).endswith("<|im_start|>assistant\n<reason>")


def test_the_builtin_chatml_layout_puts_each_tools_schema_on_its_own_line():
    from tirl.agent.tools import BUILTIN_TOOLS

    names = list(BUILTIN_TOOLS)
    assert len(names) >= 2
    cfg = AgentConfig(tools=names, use_chat_template=False, system_prompt="S", user_prompt="U", prefill="")
    schemas = tool_schemas(cfg)
    assert [s["function"]["name"] for s in schemas] == names
    text = build_prompt_text(CharTokenizer(None), "Q", cfg)
    inner = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in inner.split("\n")] == list(schemas)
    assert text == (
        "<|im_start|>system\nS\n\n# Tools\n<tools>\n"
        + "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
        + "\n</tools><|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_default_tool_and_schema_non_ascii_kept():
    assert TOOL_NAME == NAME and TOOL_SCHEMA["function"]["name"] == NAME
    tok = CharTokenizer(None)
    schema = {"type": "function", "function": {"name": "é", "parameters": {"properties": {}}}}
    text = build_prompt_text(tok, "Q", AgentConfig(tool_schema=schema, prefill=""))
    assert '"name": "é"' in text


def test_render_tool_response_tokenizes_the_segment():
    tok = CharTokenizer()
    cfg = AgentConfig(prefill="")
    assert render_tool_response(tok, ["r"], cfg) == [ord(c) for c in tool_response_text(["r"], cfg, False)]
    closed = render_tool_response(tok, ["r"], cfg, turn_closed=True)
    assert closed == [ord(c) for c in tool_response_text(["r"], cfg, True)]


def test_check_context_at_its_boundary():
    tok = CharTokenizer(None)
    cfg = AgentConfig(system_prompt="", user_prompt="{problem}", prefill="", max_response_tokens=100)
    problems = [Problem("a", "x" * 10, "1"), Problem("b", "y" * 30, "1"), Problem("c", "z", "1")]
    longest = len(build_prompt_ids(tok, "y" * 30, cfg))
    assert longest_prompt(tok, problems, cfg) == longest
    assert longest_prompt(tok, [], cfg) == 0
    assert check_context(tok, problems, cfg, longest + 1, "train") == longest
    with pytest.raises(ConfigError) as err:
        check_context(tok, problems, cfg, longest, "eval")
    assert str(err.value) == (
        f"eval: a prompt of {longest} tokens does not fit engine.max_model_len={longest}; "
        f"raise it to at least {longest + 100} (prompt + max_response_tokens)"
    )


def test_check_context_looks_at_the_64_longest_texts():
    tok = CharTokenizer(None)
    cfg = AgentConfig(system_prompt="", user_prompt="{problem}", prefill="")
    short = [Problem(str(i), "s" * (i % 7), "1") for i in range(100)]
    problems = [*short[:50], Problem("long", "L" * 500, "1"), *short[50:]]
    assert check_context(tok, problems, cfg, 10_000, "x") == len(build_prompt_ids(tok, "L" * 500, cfg))
