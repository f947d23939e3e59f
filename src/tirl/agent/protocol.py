"""The tool protocol: prompt, tool schema, parsing <tool_call>, and tool-response token segments.

Everything the model sees is built in token space. The prompt is the chat template's rendering;
each tool response is a segment `<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response>
<|im_end|>\\n<|im_start|>assistant\\n` + prefill, tokenized on its own and appended to the exact
generated ids. Because the segment starts and ends at special tokens, the concatenation is what the
chat template would produce for the same conversation, and no decoded text is ever re-encoded. The
tool's text inside the segment is untrusted: its control-token strings (`<|im_end|>`, `</tool_response>`)
are tokenized as plain text (tirl.agent.framing), so only the frame written here delimits turns.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from tirl.agent.config import AgentConfig
from tirl.agent.framing import Piece, encode_framed
from tirl.agent.tools import PythonTool, schema_name, toolbox
from tirl.config import ConfigError

# The paper's tool, the default (tirl.agent.tools.PythonTool).
TOOL_NAME = PythonTool.name
TOOL_SCHEMA: dict = PythonTool.schema()

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful mathematician who solves problems by reasoning and by running Python code. "
    "Think step by step inside <reason> </reason>. Whenever a computation, a check or an exploration "
    "is easier in code, call the Python tool: write the call as "
    '<tool_call>{"name": "execute_python_code_with_standard_io", "arguments": {"code": "...", "input": ""}}'
    "</tool_call> and wait for its output, which arrives inside <tool_response> </tool_response>. "
    "After reasoning, give exactly one final answer inside <answer> </answer>, with the final result "
    "in \\boxed{}."
)

DEFAULT_USER_PROMPT = (
    "Solve the problem below. Reason inside <reason> </reason>, use the Python tool when it helps, and "
    "end with exactly one <answer> </answer> block whose final result is in \\boxed{{}}.\n\n{problem}"
)

_TYPES = {
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "object": dict,
    "array": list,
    "null": type(None),
}


@dataclass
class ToolCall:
    name: str
    arguments: dict
    start: int  # character span of <tool_call>...</tool_call> in the turn's text
    end: int


@dataclass
class ToolCallError:
    message: str  # sent back to the model as the tool response
    raw: str = ""
    start: int = 0
    end: int = 0

    def render(self) -> str:
        return f"Error: {self.message}"


@dataclass
class _Schema:
    name: str
    properties: dict = field(default_factory=dict)
    required: tuple[str, ...] = ()


def _schema_of(schema: dict) -> _Schema:
    fn = schema.get("function", schema)
    params = fn.get("parameters", {})
    return _Schema(fn["name"], params.get("properties", {}), tuple(params.get("required", ())))


def _schemas_of(tools: dict | Sequence[dict] | None) -> dict[str, _Schema]:
    if tools is None:
        tools = [TOOL_SCHEMA]
    elif isinstance(tools, dict):
        tools = [tools]
    return {schema_name(t): _schema_of(t) for t in tools}


# ---- parsing ----

_TAG = re.compile(r"<tool_call>|</tool_call>")
_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"


def parse_tool_calls(
    text: str, max_calls: int | None = None, tools: dict | Sequence[dict] | None = None
) -> list[ToolCall | ToolCallError]:
    """Every <tool_call> block of one turn, in order: a ToolCall, or a ToolCallError saying what is wrong.

    Each call is checked against the schema of the tool it names; `tools` is the schemas the model
    was shown (one or several; default: the paper's Python tool). Calls beyond `max_calls` become
    errors (the model learns the limit instead of being ignored).
    """
    schemas = _schemas_of(tools)
    out: list[ToolCall | ToolCallError] = []
    open_at: int | None = None
    for m in _TAG.finditer(text):
        if m.group() == "<tool_call>":
            if open_at is not None:
                out.append(
                    ToolCallError(
                        "<tool_call> opened again before the previous one was closed with </tool_call>",
                        text[open_at : m.start()],
                        open_at,
                        m.start(),
                    )
                )
            open_at = m.start()
            continue
        if open_at is None:
            out.append(
                ToolCallError("found </tool_call> without a matching <tool_call>", "", m.start(), m.end())
            )
            continue
        body_start = open_at + len("<tool_call>")
        out.append(_parse_one(text, open_at, body_start, m.start(), m.end(), schemas))
        open_at = None
    if open_at is not None:
        out.append(
            ToolCallError(
                "unclosed <tool_call>: end the call with </tool_call>", text[open_at:], open_at, len(text)
            )
        )
    if max_calls is not None:
        for n, item in enumerate(out[max_calls:], start=max_calls + 1):
            out[n - 1] = ToolCallError(
                f"only {max_calls} tool call(s) per turn are executed; call #{n} was skipped: "
                "make one call, read its result, then continue",
                "",
                item.start,
                item.end,
            )
    return out


def _parse_one(
    text: str, start: int, body_start: int, body_end: int, end: int, schemas: dict[str, _Schema]
) -> ToolCall | ToolCallError:
    raw = text[body_start:body_end]

    def error(message: str) -> ToolCallError:
        return ToolCallError(message, raw, start, end)

    before = text[:start]
    if before.count(_ANSWER_OPEN) > before.count(_ANSWER_CLOSE):
        return error("tool call inside <answer>: call tools before answering, the answer must be final")
    body = raw.strip()
    if not body:
        return error(
            'empty tool call: put a JSON object {"name": ..., "arguments": {...}} inside <tool_call>'
        )
    try:
        obj, used = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as exc:
        return error(f"invalid JSON in tool call: {exc.msg} at line {exc.lineno} column {exc.colno}")
    if body[used:].strip():
        extra = body[used:].strip()
        return error(f"unexpected text after the JSON object in tool call: {extra[:40]!r}")
    if not isinstance(obj, dict):
        return error(
            f'a tool call must be a JSON object with "name" and "arguments", got a JSON {_json_type(obj)}'
        )
    unknown_keys = sorted(set(obj) - {"name", "arguments"})
    if unknown_keys:
        return error(
            f'unexpected key(s) {", ".join(map(repr, unknown_keys))} in tool call: only "name" and "arguments"'
        )
    if "name" not in obj:
        return error('tool call has no "name"')
    name = obj["name"]
    if not isinstance(name, str):  # a model may write an object or a list here: not a key to look up
        return error(f'"name" must be a JSON string, got a JSON {_json_type(name)}')
    if name not in schemas:
        if len(schemas) == 1:
            return error(f"unknown tool {name!r}: the only tool is {next(iter(schemas))!r}")
        return error(f"unknown tool {name!r}: the tools are {', '.join(map(repr, schemas))}")
    schema = schemas[name]
    if "arguments" not in obj:
        return error('tool call has no "arguments" object')
    args = obj["arguments"]
    if not isinstance(args, dict):
        return error(f'"arguments" must be a JSON object, got a JSON {_json_type(args)}')
    missing = [k for k in schema.required if k not in args]
    if missing:
        return error(f"missing required argument(s) {', '.join(map(repr, missing))} for {schema.name}")
    extra = sorted(set(args) - set(schema.properties))
    if extra:
        allowed = ", ".join(map(repr, schema.properties))
        return error(
            f"unexpected argument(s) {', '.join(map(repr, extra))} for {schema.name} (allowed: {allowed})"
        )
    for key, value in args.items():
        expected = schema.properties[key].get("type")
        if expected in _TYPES and (
            not isinstance(value, _TYPES[expected]) or (expected != "boolean" and isinstance(value, bool))
        ):
            return error(f"argument {key!r} must be a JSON {expected}, got a JSON {_json_type(value)}")
    return ToolCall(name, args, start, end)


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


# The frame tirl writes around a tool's output (tool_response_pieces). A model that writes it in its own
# turn makes up an observation: trained on, it is learned as if the environment had said it.
_FORGED_TAGS = re.compile(r"</?tool_response>")
_CALL_SPAN = re.compile(r"<tool_call>.*?</tool_call>", re.S)  # closed: an unclosed one shields nothing
_FRAME_HEAD = "<|im_start|>user\n"  # the frame's opening before the tag, when the model writes it too


def forged_frame_at(text: str) -> int | None:
    """Where the model's own turn starts writing a tool-response frame (`<tool_response>` or
    `</tool_response>`, with the `<|im_start|>user\n` before it if written), or None. Text inside a
    closed `<tool_call>` (a program that prints the tag) is the call's, not a frame."""
    calls = [m.span() for m in _CALL_SPAN.finditer(text)]
    for m in _FORGED_TAGS.finditer(text):
        if not any(a <= m.start() < b for a, b in calls):
            at = m.start()
            return at - len(_FRAME_HEAD) if text[:at].endswith(_FRAME_HEAD) else at
    return None


def count_answer_blocks(text: str) -> int:
    """Number of <answer> blocks a turn opened (RoC's p_format penalizes more than one)."""
    return text.count(_ANSWER_OPEN)


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep the head and the tail of a long tool output, saying how much was cut."""
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters omitted] ...\n{text[-half:]}"


# ---- rendering in token space ----


def supports_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template


def build_prompt_text(tokenizer, problem_text: str, cfg: AgentConfig) -> str:
    """System + user turn with the tool schema, the assistant header and the prefill."""
    system = cfg.system_prompt if cfg.system_prompt is not None else DEFAULT_SYSTEM_PROMPT
    user = (cfg.user_prompt or DEFAULT_USER_PROMPT).format(problem=problem_text)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    schemas = list(tool_schemas(cfg))
    if cfg.use_chat_template and supports_tools(tokenizer):
        text = tokenizer.apply_chat_template(
            messages, tools=schemas, add_generation_prompt=True, tokenize=False
        )
    else:
        text = _render_chatml(system, user, schemas)
    return text + cfg.prefill


def tool_schemas(cfg: AgentConfig) -> tuple[dict, ...]:
    """The schemas of the config's tools, as the model sees them in <tools>."""
    return toolbox(cfg.tools, cfg.tool_schema).schemas


def _render_chatml(system: str, user: str, schemas: list[dict]) -> str:
    """The built-in ChatML layout for tokenizers whose template knows no tools (one schema per line)."""
    lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    tools = f"\n\n# Tools\n<tools>\n{lines}\n</tools>"
    return f"<|im_start|>system\n{system}{tools}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def build_prompt_ids(tokenizer, problem_text: str, cfg: AgentConfig) -> list[int]:
    return encode(tokenizer, build_prompt_text(tokenizer, problem_text, cfg))


def tool_response_pieces(responses: list[str], cfg: AgentConfig, turn_closed: bool) -> list[Piece]:
    """The user turn carrying the tool responses, up to the next assistant header and its prefill, as
    (text, trusted) pieces: the frame is trusted, each response is not.

    `turn_closed`: the generated turn already ended with <|im_end|> (no tool-call stop).
    """
    prefill = cfg.prefill if cfg.continue_prefill is None else cfg.continue_prefill
    pieces: list[Piece] = [(f"{'' if turn_closed else '<|im_end|>'}\n<|im_start|>user", True)]
    for r in responses:
        pieces += [("\n<tool_response>\n", True), (r, False), ("\n</tool_response>", True)]
    return [*pieces, (f"<|im_end|>\n<|im_start|>assistant\n{prefill}", True)]


def tool_response_text(responses: list[str], cfg: AgentConfig, turn_closed: bool) -> str:
    """The tool-response segment as text (SFT traces, displays); the model gets `render_tool_response`."""
    return "".join(text for text, _ in tool_response_pieces(responses, cfg, turn_closed))


def render_tool_response(
    tokenizer, responses: list[str], cfg: AgentConfig, turn_closed: bool = False
) -> list[int]:
    """The tool-response segment as token ids, tokenized on its own (loss mask 0 in the trajectory):
    the responses' control-token strings are plain text (tirl.agent.framing.encode_framed)."""
    return encode_framed(tokenizer, tool_response_pieces(responses, cfg, turn_closed))


def longest_prompt(tokenizer, problems, agent_cfg) -> int:
    """Tokens of the longest prompt: the engine's context must hold it plus the response budget."""
    return max((len(build_prompt_ids(tokenizer, p.problem, agent_cfg)) for p in problems), default=0)


def check_context(tokenizer, problems, agent_cfg, max_model_len: int, where: str) -> int:
    """Fail before the first rollout when a prompt does not fit the engine's context (it would fail
    every rollout of that problem); returns the longest prompt's length. Tokenizes the 64 longest
    problem texts only, so a large training set costs no time."""
    longest = sorted(problems, key=lambda p: len(p.problem), reverse=True)[:64]
    prompt = longest_prompt(tokenizer, longest, agent_cfg)
    if prompt >= max_model_len:
        raise ConfigError(
            f"{where}: a prompt of {prompt} tokens does not fit engine.max_model_len={max_model_len}; "
            f"raise it to at least {prompt + agent_cfg.max_response_tokens} (prompt + max_response_tokens)"
        )
    return prompt
