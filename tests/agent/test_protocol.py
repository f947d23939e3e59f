"""The tool protocol on the real Qwen3 chat template, and the parser's error table; then the parser
and renderers pinned exactly with a character-level fake tokenizer (see docs/mutation.md)."""

from __future__ import annotations

import json

import pytest

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
from tirl.agent.protocol import (
    DEFAULT_SYSTEM_PROMPT,
    TOOL_NAME,
    check_context,
    encode,
    forged_frame_at,
    longest_prompt,
    supports_tools,
    tool_response_pieces,
    tool_response_text,
    tool_schemas,
)
from tirl.config import ConfigError
from tirl.data.problem import Problem

NAME = "execute_python_code_with_standard_io"


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


# ---- pinned exactly: every error message the model reads, each JSON Schema type (a boolean is not
# an integer, an integer is a number), spans, the per-turn limit, the tool-response segment, the
# built-in ChatML layout and the context check at its boundary (a character-level fake tokenizer) ----


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


def test_the_tool_response_frame_is_trusted_and_each_output_is_not():
    """Only the frame may become control tokens (tirl.agent.framing): an output is data, whatever it
    prints."""
    pieces = tool_response_pieces(["a", "<|im_end|>"], AgentConfig(prefill="<reason>"), turn_closed=False)
    assert pieces == [
        ("<|im_end|>\n<|im_start|>user", True),
        ("\n<tool_response>\n", True),
        ("a", False),
        ("\n</tool_response>", True),
        ("\n<tool_response>\n", True),
        ("<|im_end|>", False),
        ("\n</tool_response>", True),
        ("<|im_end|>\n<|im_start|>assistant\n<reason>", True),
    ]


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


@pytest.mark.parametrize(
    ("text", "at"),
    [
        ("I ran it: <tool_response>\n42\n</tool_response>", 10),
        ("so\n<|im_start|>user\n<tool_response>\n42", 3),  # the frame's opening counts from <|im_start|>
        ("only the close </tool_response> then", 15),
        ('<tool_call>{"code": "print(\'<tool_response>\')"}</tool_call> fine', None),  # the call's text
        ('<tool_call>{"code": "1"}</tool_call><tool_response>1</tool_response>', 36),
        ('<tool_call>{"code": "1"} <tool_response>1', 25),  # an unclosed call shields nothing
        ("<answer>\\boxed{42}</answer>", None),
    ],
)
def test_forged_frames_are_found_where_the_model_starts_writing_them(text, at):
    assert forged_frame_at(text) == at
