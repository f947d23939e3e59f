"""Token drift: whether the tokens a trajectory was trained on are its chat template's rendering.

The field's drift bug: a multi-turn conversation is kept as messages and rendered through the chat
template again for training, and the rendering differs from what the model sampled (tool-call JSON
re-formatted, consecutive tool messages merged, text trimmed, two pieces tokenized as one). tirl works
in token space (sampled ids kept, tool-response segments tokenized on their own, no text re-encoded),
so its trained tokens are what the model saw; this check says whether that is also what the template
renders. Each turn's context is rendered with the generation prompt (what an inference server would
send for that turn) and the whole conversation without it; each rendering is tokenized whole and
compared with the trained ids (prompt + response). Every difference is reported with its first
position and the decoded tokens around it.

The conversation comes from the caller (the OpenAI recorder keeps its messages) or, for a record of
tirl's agent loop, from `conversation`: the system and user prompt the agent config writes, each model
turn as an assistant message (its prefill included), and the tool outputs read from the tool-response
segments (the loss mask's 0-runs) as the protocol frames them (tirl.agent.protocol.tool_response_pieces).
A template with tools gets them as `tool` messages; the built-in ChatML layout (a template without tool
support, or agent.use_chat_template=false) is given as the protocol writes it: the tool schemas in the
system message, each turn's tool responses as one user message in `<tool_response>` tags. Asked for
`tool` messages, a template without tool support (SmolLM2's ChatML) gets the schemas in the system
message still, and the check shows where its tool role differs from the protocol's frame.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from tirl.agent.config import AgentConfig
from tirl.agent.protocol import (
    DEFAULT_SYSTEM_PROMPT,
    DEFAULT_USER_PROMPT,
    encode,
    parse_tool_calls,
    supports_tools,
    tool_schemas,
)
from tirl.agent.trajectory import Trajectory, generated_runs

_END_OF_TURN = ("<|im_end|>", "<|eot_id|>")  # what a template writes itself after an assistant turn
_OPEN, _CLOSE = "\n<tool_response>\n", "\n</tool_response>"  # the protocol's frame per response


class DriftError(ValueError):
    """The record cannot be checked (no token ids, or not tirl's tool-response frame): says why."""


@dataclass
class Difference:
    where: str  # "context of turn 2" or "whole conversation"
    position: int  # first differing token, counted in prompt + response
    before: str  # the tokens before it (the same on both sides), decoded
    trained: list[str]  # the trained tokens from it on, each decoded alone (a split shows)
    rendered: list[str]  # the template's tokens from it on


@dataclass
class DriftReport:
    renderings: int = 0  # renderings compared with the trained tokens
    differences: list[Difference] = field(default_factory=list)
    tool_messages: str = "tool"  # how tool output reached the template: "tool" messages or "user" turns


def check_drift(
    tokenizer,
    messages: Sequence[dict],
    tools: Sequence[dict] | None,
    traj: Trajectory,
    prefill: str = "",
    continue_prefill: str | None = None,
    tool_messages: str = "tool",
) -> DriftReport:
    """Compare each turn's context and the whole conversation, rendered by the template, with the trained
    ids of `traj`. `messages` hold one assistant message per generated run, each with what was written
    after its header (the prefill) and without the end-of-turn token the template writes itself."""
    full = list(traj.prompt_ids) + list(traj.response_ids)
    starts = _turn_starts(traj)
    assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if len(assistants) != len(starts):
        raise DriftError(
            f"{len(assistants)} assistant messages for {len(starts)} generated turns: not this trajectory's"
        )
    again = prefill if continue_prefill is None else continue_prefill
    report = DriftReport(tool_messages=tool_messages)
    for k, (index, start) in enumerate(zip(assistants, starts, strict=True)):
        text = _render(tokenizer, messages[:index], tools, True) + (prefill if k == 0 else again)
        _compare(tokenizer, report, f"context of turn {k}", encode(tokenizer, text), full[:start])
    ends_in_tool = bool(messages) and messages[-1].get("role") != "assistant"
    whole = _render(tokenizer, messages, tools, ends_in_tool) + (again if ends_in_tool else "")
    rendered = encode(tokenizer, whole)
    # What the template writes after the last generated token (its end-of-turn, a newline) was not trained.
    rest = tokenizer.decode(rendered[len(full) :], skip_special_tokens=True)
    _compare(
        tokenizer, report, "whole conversation", rendered[: len(full)] if not rest.strip() else rendered, full
    )
    return report


def _render(tokenizer, messages: Sequence[dict], tools, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        list(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=generation_prompt,
        tokenize=False,
    )


def _turn_starts(traj: Trajectory) -> list[int]:
    """Where each generated run starts, counted in prompt + response."""
    mask, base = traj.loss_mask, len(traj.prompt_ids)
    return [base + i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]


def _compare(tokenizer, report: DriftReport, where: str, rendered: list[int], trained: list[int]) -> None:
    report.renderings += 1
    if rendered == trained:
        return
    n = min(len(rendered), len(trained))
    at = next((i for i in range(n) if rendered[i] != trained[i]), n)
    report.differences.append(
        Difference(
            where,
            at,
            _decode(tokenizer, trained[max(0, at - 8) : at]),
            *_decode_from(tokenizer, at, trained, rendered),
        )
    )


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def _decode_from(tokenizer, at: int, *sides: list[int], width: int = 6) -> list[list[str]]:
    return [[_decode(tokenizer, [i]) for i in ids[at : at + width]] for ids in sides]


# ---- a record of tirl's agent loop as a conversation ----


def conversation(
    tokenizer, traj: Trajectory, problem: str, cfg: AgentConfig, tool_messages: str = "auto"
) -> tuple[list[dict], list[dict] | None, str]:
    """The messages, the tools and the tool-message mapping ("tool" or "user") of a loop trajectory with
    token ids. `tool_messages="auto"`: tool messages where the run rendered its prompt with the template
    (it has tools and agent.use_chat_template), else the protocol's built-in ChatML layout."""
    if not traj.prompt_ids or len(traj.loss_mask) != len(traj.response_ids):
        raise DriftError("the record holds no token ids (a training run's sample keeps counts only)")
    if tool_messages == "auto":
        tool_messages = "tool" if cfg.use_chat_template and supports_tools(tokenizer) else "user"
    schemas = list(tool_schemas(cfg))
    system = cfg.system_prompt if cfg.system_prompt is not None else DEFAULT_SYSTEM_PROMPT
    # tirl.agent.protocol._render_chatml's system turn; also under a template that ignores `tools`
    # (SmolLM2's ChatML), so that "tool" mode shows where its tool role differs, not the lost schemas.
    in_system = tool_messages == "user" or not supports_tools(tokenizer)
    if in_system:
        lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
        system += f"\n\n# Tools\n<tools>\n{lines}\n</tools>"
    user = (cfg.user_prompt or DEFAULT_USER_PROMPT).format(problem=problem)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    again = cfg.prefill if cfg.continue_prefill is None else cfg.continue_prefill
    turns = generated_runs(traj.response_ids, traj.loss_mask)
    segments = _tool_runs(traj)
    for k, run in enumerate(turns):
        text = tokenizer.decode(run, skip_special_tokens=False)
        messages.append(
            {"role": "assistant", "content": (cfg.prefill if k == 0 else again) + _open_turn(text)}
        )
        if k < len(segments):
            calls = len(parse_tool_calls(text, cfg.max_calls_per_turn, schemas))
            outputs = _responses(tokenizer.decode(segments[k], skip_special_tokens=False), calls, again)
            messages += _tool_turn(outputs, tool_messages)
    return messages, None if in_system else schemas, tool_messages


def _open_turn(text: str) -> str:
    """The turn without the end-of-turn token the model generated (the template writes its own)."""
    for eot in _END_OF_TURN:
        if text.endswith(eot):
            return text[: -len(eot)]
    return text


def _tool_runs(traj: Trajectory) -> list[list[int]]:
    """The tool-response segments after each generated run (the loss mask's 0-runs after the first 1)."""
    flipped = [1 - m for m in traj.loss_mask]
    first = traj.loss_mask.index(1) if 1 in traj.loss_mask else len(flipped)
    return generated_runs(traj.response_ids[first:], flipped[first:])


def _responses(segment: str, calls: int, prefill: str) -> list[str]:
    """The tool outputs in one segment as tirl.agent.protocol.tool_response_pieces frames them."""
    body = segment.removeprefix("<|im_end|>")
    head, tail = "\n<|im_start|>user", f"<|im_end|>\n<|im_start|>assistant\n{prefill}"
    if not (body.startswith(head + _OPEN) and body.endswith(_CLOSE + tail)):
        raise DriftError(f"a tool segment is not tirl's tool-response frame: {segment[:60]!r}")
    inner = body[len(head + _OPEN) : len(body) - len(_CLOSE + tail)]
    return inner.split(_CLOSE + _OPEN, max(calls - 1, 0))


def _tool_turn(outputs: list[str], tool_messages: str) -> list[dict]:
    if tool_messages == "tool":
        return [{"role": "tool", "content": out} for out in outputs]
    framed = (_OPEN + out + _CLOSE for out in outputs)
    return [{"role": "user", "content": "".join(framed).removeprefix("\n")}]


def check_record(tokenizer, record: dict, cfg: AgentConfig, tool_messages: str = "auto") -> DriftReport:
    """`check_drift` on one stored trajectory of tirl's agent loop (a line of an eval's
    trajectories.jsonl); DriftError when it cannot be checked."""
    traj = Trajectory.from_dict(record)
    messages, tools, mode = conversation(tokenizer, traj, str(record.get("problem", "")), cfg, tool_messages)
    return check_drift(tokenizer, messages, tools, traj, cfg.prefill, cfg.continue_prefill, mode)


def describe(index: int, record: dict, report: DriftReport) -> str:
    """One line per trajectory: where its renderings differ from the trained tokens (each distinct
    position once, with the renderings that differ there)."""
    name = f"#{index + 1} {record.get('problem_id', '?')}/{record.get('sample_index', 0)}"
    if not report.differences:
        return f"{name}: no drift ({report.renderings} renderings)"
    shown = []
    for at in sorted({d.position for d in report.differences}):
        here = [d for d in report.differences if d.position == at]
        first = here[0]
        shown.append(
            f"{', '.join(d.where for d in here)} at token {at}, after {first.before!r}: "
            f"trained {first.trained}, template {first.rendered}"
        )
    return f"{name}: {len(report.differences)} of {report.renderings} renderings differ: {'; '.join(shown)}"
