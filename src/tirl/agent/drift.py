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
    rendered_length: int | None = None  # counts only: the rendering's tokens where `position` were trained
    # The same text split into other tokens: the model sampled a split its tokenizer would not write
    # (`in`+`ical` for `inical`). tirl trains on the sampled tokens; a framework that re-renders the
    # messages would train on tokens that were never sampled. Not a difference in what the model saw.
    resplit: bool = False


@dataclass
class DriftReport:
    renderings: int = 0  # renderings compared with the trained tokens
    differences: list[Difference] = field(default_factory=list)
    tool_messages: str = "tool"  # how tool output reached the template: "tool" messages or "user" turns
    counts_only: bool = False  # no token ids in the record: token counts at the turn boundaries compared

    @property
    def text_differences(self) -> list[Difference]:
        """The differences in text (the template renders something else), not only in the split."""
        return [d for d in self.differences if not d.resplit]


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
    again = prefill if continue_prefill is None else continue_prefill
    shown = renderings(tokenizer, messages, tools, prefill, again)
    if len(shown) != len(starts) + 1:
        raise DriftError(
            f"{len(shown) - 1} assistant messages for {len(starts)} generated turns: not this trajectory's"
        )
    report = DriftReport(tool_messages=tool_messages)
    for (where, ids), end in zip(shown, [*starts, len(full)], strict=True):
        _compare(tokenizer, report, where, _trimmed(tokenizer, where, ids, end), full[:end])
    return report


def renderings(
    tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None, prefill: str, again: str
) -> list[tuple[str, list[int]]]:
    """Each assistant turn's context (the generation prompt, then `prefill` on the first turn and
    `again` on later ones) and the whole conversation, rendered by the template and tokenized whole."""
    assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    out = []
    for k, index in enumerate(assistants):
        text = _render(tokenizer, messages[:index], tools, True) + (prefill if k == 0 else again)
        out.append((f"context of turn {k}", encode(tokenizer, text)))
    ends_in_tool = bool(messages) and messages[-1].get("role") != "assistant"
    whole = _render(tokenizer, messages, tools, ends_in_tool) + (again if ends_in_tool else "")
    return [*out, ("whole conversation", encode(tokenizer, whole))]


def _trimmed(tokenizer, where: str, rendered: list[int], trained: int) -> list[int]:
    """The whole conversation's rendering without what the template writes after the last trained
    token (its end-of-turn, a newline: never generated, never trained); a context as it is."""
    if where != "whole conversation":
        return rendered
    rest = tokenizer.decode(rendered[trained:], skip_special_tokens=True)
    return rendered[:trained] if not rest.strip() else rendered


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
            resplit=_same_text(_decode(tokenizer, trained), _decode(tokenizer, rendered)),
        )
    )


def _same_text(trained: str, rendered: str) -> bool:
    """The same text, up to what the template writes after the last trained token (its end of turn)."""
    if not rendered.startswith(trained):
        return False
    rest = rendered[len(trained) :]
    for end in _END_OF_TURN:
        rest = rest.replace(end, "")
    return not rest.strip()


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def _decode_from(tokenizer, at: int, *sides: list[int], width: int = 6) -> list[list[str]]:
    return [[_decode(tokenizer, [i]) for i in ids[at : at + width]] for ids in sides]


# ---- a record of tirl's agent loop as a conversation ----


def conversation(
    tokenizer,
    problem: str,
    cfg: AgentConfig,
    turns: Sequence[str],
    segments: Sequence[str],
    tool_messages: str = "auto",
) -> tuple[list[dict], list[dict] | None, str]:
    """The messages, the tools and the tool-message mapping ("tool" or "user") of a loop trajectory: its
    model turns and the tool-response segment after each, as decoded. `tool_messages="auto"`: tool
    messages where the run rendered its prompt with the template (it has tools and
    agent.use_chat_template), else the protocol's built-in ChatML layout."""
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
    again = _again(cfg)
    for k, text in enumerate(turns):
        messages.append(
            {"role": "assistant", "content": (cfg.prefill if k == 0 else again) + _open_turn(text)}
        )
        if k < len(segments):
            calls = len(parse_tool_calls(text, cfg.max_calls_per_turn, schemas))
            messages += _tool_turn(_responses(segments[k], calls, again), tool_messages)
    return messages, None if in_system else schemas, tool_messages


def _again(cfg: AgentConfig) -> str:
    return cfg.prefill if cfg.continue_prefill is None else cfg.continue_prefill


def decoded_turns(tokenizer, traj: Trajectory) -> tuple[list[str], list[str]]:
    """The model turns and tool-response segments of a trajectory with token ids, each run decoded."""
    if not traj.prompt_ids or len(traj.loss_mask) != len(traj.response_ids):
        raise DriftError("the record holds no token ids")
    flipped = [1 - m for m in traj.loss_mask]
    first = traj.loss_mask.index(1) if 1 in traj.loss_mask else len(flipped)
    runs = (
        generated_runs(traj.response_ids, traj.loss_mask),
        generated_runs(traj.response_ids[first:], flipped[first:]),
    )
    turns, segments = ([tokenizer.decode(r, skip_special_tokens=False) for r in side] for side in runs)
    return turns, segments


def located_turns(traj: Trajectory, cfg: AgentConfig) -> tuple[list[str], list[str]]:
    """The model turns and tool-response segments of a record without token ids (a training run's
    sample), the segments located in its decoded text: each ends at the first frame close followed by
    the next turn (a tool output that prints both could move it; records with ids are exact)."""
    text, turns, tail = (
        traj.response_text,
        traj.model_turns,
        f"<|im_end|>\n<|im_start|>assistant\n{_again(cfg)}",
    )
    segments, at = [], 0
    for k, turn in enumerate(turns):
        if not text.startswith(turn, at):
            raise DriftError(f"model turn {k} is not where the record's text has it")
        at += len(turn)
        if k + 1 < len(turns):
            end = text.find(tail + turns[k + 1], at)
            if end < 0:
                raise DriftError(f"no tool-response segment found after model turn {k}")
            segments.append(text[at : end + len(tail)])
            at = end + len(tail)
        elif at < len(text):
            segments.append(text[at:])
    return turns, segments


def _open_turn(text: str) -> str:
    """The turn without the end-of-turn token the model generated (the template writes its own)."""
    for eot in _END_OF_TURN:
        if text.endswith(eot):
            return text[: -len(eot)]
    return text


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
    """The drift of one stored trajectory of tirl's agent loop: token by token where the record keeps
    its ids (an eval's trajectories.jsonl), else by the token count at each turn boundary (a training
    run's sample keeps `prompt_tokens` and `turn_tokens`); DriftError when it cannot be checked."""
    traj = Trajectory.from_dict(record)
    problem = str(record.get("problem", ""))
    if traj.prompt_ids:
        turns, segments = decoded_turns(tokenizer, traj)
        messages, tools, mode = conversation(tokenizer, problem, cfg, turns, segments, tool_messages)
        return check_drift(tokenizer, messages, tools, traj, cfg.prefill, cfg.continue_prefill, mode)
    prompt, counts = record.get("prompt_tokens"), record.get("turn_tokens")
    if not isinstance(prompt, int) or not isinstance(counts, list):
        raise DriftError("the record holds neither token ids nor token counts")
    turns, segments = located_turns(traj, cfg)
    messages, tools, mode = conversation(tokenizer, problem, cfg, turns, segments, tool_messages)
    bounds = [prompt + sum(g + t for g, t in counts[:k]) for k in range(len(counts) + 1)]
    return check_counts(tokenizer, messages, tools, bounds, cfg.prefill, _again(cfg), mode)


def check_counts(
    tokenizer,
    messages: Sequence[dict],
    tools: Sequence[dict] | None,
    bounds: Sequence[int],
    prefill: str,
    again: str,
    tool_messages: str,
) -> DriftReport:
    """`check_drift` without the trained ids: each rendering's token count against the trained count at
    that boundary (`bounds`: where each turn starts, then the end). Equal counts do not prove equal
    tokens; a different count proves drift."""
    shown = renderings(tokenizer, messages, tools, prefill, again)
    if len(shown) != len(bounds):
        raise DriftError(f"{len(shown) - 1} assistant messages for {len(bounds) - 1} counted turns")
    report = DriftReport(tool_messages=tool_messages, counts_only=True)
    for (where, ids), end in zip(shown, bounds, strict=True):
        _count(tokenizer, report, where, _trimmed(tokenizer, where, ids, end), end)
    return report


def _count(tokenizer, report: DriftReport, where: str, rendered: list[int], trained: int) -> None:
    report.renderings += 1
    if len(rendered) != trained:
        at = min(len(rendered), trained)
        before = _decode(tokenizer, rendered[max(0, at - 8) : at])
        report.differences.append(
            Difference(where, trained, before, [], _decode_from(tokenizer, at, rendered)[0], len(rendered))
        )


def describe(index: int, record: dict, report: DriftReport) -> str:
    """One line per trajectory: where its renderings differ from the trained tokens (each distinct
    position once, with the renderings that differ there)."""
    name = f"#{index + 1} {record.get('problem_id', '?')}/{record.get('sample_index', 0)}"
    kind = "token counts of " if report.counts_only else ""
    if not report.differences:
        return f"{name}: no drift ({kind}{report.renderings} renderings)"
    shown = []
    for at in sorted({d.position for d in report.differences}):
        here = [d for d in report.differences if d.position == at]
        first, wheres = here[0], ", ".join(d.where for d in here)
        if first.rendered_length is not None:
            shown.append(
                f"{wheres}: {at} tokens trained, {first.rendered_length} rendered, after {first.before!r}"
            )
        else:
            split = " (the same text, split otherwise)" if all(d.resplit for d in here) else ""
            shown.append(
                f"{wheres} at token {at}{split}, after {first.before!r}: "
                f"trained {first.trained}, template {first.rendered}"
            )
    differ = f"{len(report.differences)} of {kind}{report.renderings} renderings differ"
    return f"{name}: {differ}: {'; '.join(shown)}"
