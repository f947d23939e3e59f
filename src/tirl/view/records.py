"""What the viewer shows: stored trajectories (an eval's or a training run's) turned into display records.

A stored trajectory keeps the model's own turns (`model_turns`, the decoded runs of its generated
tokens) and the decoded response text. Each shown turn is a model turn, never a piece of the text:
a tool can print anything, chat markup and an `<answer>` included, so only the tool-response
segments between the model's turns (the loss mask's 0-runs, located in the text) are read for the
tool's output, and the answer is read from the model's turns only. Each turn's tool calls are
re-parsed with the agent's own parser and paired with their recorded status and tool response; RoC's
penalties are added (tirl.rl.roc). Records written before `model_turns` existed are split by their
text as before, with a note saying a tool's output may pass for a turn there. Token ids and
log-probs are dropped: the page shows text, and 10,000 trajectories must stay a file a browser opens
at once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tirl.agent.config import AgentConfig
from tirl.agent.loop import call_source
from tirl.agent.protocol import ToolCall, ToolCallError, parse_tool_calls
from tirl.agent.trajectory import ToolCallRecord, Trajectory, turn_token_counts
from tirl.data.loaders import DataError, read_jsonl
from tirl.reward import extract_answer
from tirl.rl.roc import penalties

TRAJECTORIES = "trajectories.jsonl"

# An old record's tool-response segment as tirl.agent.protocol.tool_response_text writes it (the prefill
# after it stays with the next turn's text, where the model reads it).
_SEGMENT = re.compile(
    r"(?:<\|im_end\|>)?\n<\|im_start\|>user((?:\n<tool_response>\n.*?\n</tool_response>)*)"
    r"<\|im_end\|>\n<\|im_start\|>assistant\n",
    re.S,
)
_RESPONSE = re.compile(r"\n<tool_response>\n(.*?)\n</tool_response>", re.S)


class ViewError(ValueError):
    """PATH cannot be shown; the message says what is wrong and what to give instead."""


@dataclass
class Source:
    """What `tirl view PATH` found at PATH."""

    kind: str  # "eval", "train" or "trajectories" (a bare JSONL file)
    path: Path
    records: list[dict]  # one stored trajectory per line of trajectories.jsonl
    summary: dict = field(default_factory=dict)  # eval: metrics.json's benchmarks
    curves: list[dict] = field(default_factory=list)  # training: metrics.jsonl, one row per step
    agent: dict = field(default_factory=dict)  # the agent config that produced them (tool schema, limits)


def load_source(path: str | Path) -> Source:
    """Read an eval output directory, a training run directory, or a trajectories.jsonl file."""
    path = Path(path)
    if not path.exists():
        raise ViewError(f"{path}: no such file or directory ({_WHAT})")
    if path.is_file():
        return Source("trajectories", path, _read_jsonl(path))
    own = _Own(path)
    trajectories = own(TRAJECTORIES)
    if own("metrics.jsonl").exists():  # a training run
        config = _read_yaml(own("config.yaml"))
        return Source(
            "train",
            path,
            _read_jsonl(trajectories) if trajectories.exists() else [],
            curves=_read_jsonl(own("metrics.jsonl")),
            agent=_mapping(config.get("agent")),
        )
    if not trajectories.exists():
        raise ViewError(f"{path} holds neither {TRAJECTORIES} nor metrics.jsonl ({_WHAT})")
    metrics = _read_json(own("metrics.json"))
    benchmarks = _mapping(metrics.get("benchmarks"))
    return Source(
        "eval",
        path,
        _read_jsonl(trajectories),
        summary={str(k): v for k, v in benchmarks.items() if isinstance(v, dict)},
        agent=_mapping(_mapping(metrics.get("config")).get("agent")),
    )


class _Own:
    """A run directory's files, each refused (ViewError) if it is a link leading outside the directory: a
    shared run whose `trajectories.jsonl -> ~/notes.jsonl` would put that file's records into the page
    the user then shares. Links inside the run, and the run directory itself given as a link, are fine."""

    def __init__(self, root: Path) -> None:
        self.root, self.real_root = root, root.resolve()

    def __call__(self, name: str) -> Path:
        path = self.root / name
        if path.is_symlink() and not path.resolve().is_relative_to(self.real_root):
            raise ViewError(
                f"{path} is a symbolic link to {path.resolve()}, outside the run: tirl view reads only "
                "the files a run holds (replace the link by the file it should be, or view that file itself)"
            )
        return path


_WHAT = "give an eval output directory, a training run directory or a trajectories.jsonl"


def _read_jsonl(path: Path) -> list[dict]:
    """The file's records; bytes that are not UTF-8 (a lone surrogate written raw) read as U+FFFD, so a
    damaged or hostile record still shows instead of stopping the viewer."""
    try:
        return read_jsonl(path)
    except DataError as e:
        raise ViewError(f"{e}; is it a tirl JSONL file?") from None
    except UnicodeDecodeError:
        pass
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError as e:
            raise ViewError(f"{path}:{number}: not valid JSON ({e.msg}); is it a tirl JSONL file?") from None
        if row is not None and not isinstance(row, dict):
            raise ViewError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        rows += [row] if row is not None else []
    return rows


def _mapping(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return _mapping(json.loads(path.read_text(encoding="utf-8", errors="replace")))
    except json.JSONDecodeError as e:
        raise ViewError(f"{path}: not valid JSON ({e.msg}); is it a tirl eval output?") from None


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        return {}
    import yaml

    try:
        return _mapping(yaml.safe_load(path.read_text(encoding="utf-8", errors="replace")))
    except yaml.YAMLError as e:
        raise ViewError(f"{path}: not valid YAML ({str(e).splitlines()[0]}); is it a tirl run?") from None


def view_record(raw: dict, index: int, agent: dict | None = None) -> dict:
    """One stored trajectory as the page shows it (see the keys below and viewer.js). A record whose
    fields have the wrong types is one ViewError line naming it, not a traceback."""
    try:
        return _view_record(raw, index, agent or {})
    except (TypeError, ValueError, AttributeError, KeyError) as e:
        if isinstance(e, ViewError):
            raise
        raise ViewError(f"trajectory #{index + 1} is not a tirl trajectory record: {e}") from None


def _view_record(raw: dict, index: int, agent: dict) -> dict:
    traj = Trajectory.from_dict(raw)
    if not isinstance(traj.model_turns, list) or not all(isinstance(t, str) for t in traj.model_turns):
        raise ValueError("model_turns is not a list of strings")
    tokens = raw.get("turn_tokens") or turn_token_counts(traj.loss_mask)
    pen = penalties(traj, (raw.get("roc") or {}).get("no_tool_p_err", 0.5))
    turns, note = view_turns(traj, tokens, agent)
    statuses: dict[str, int] = {}
    for c in traj.tool_calls:
        statuses[c.status] = statuses.get(c.status, 0) + 1
    return {
        "id": index,
        "bench": raw.get("benchmark", ""),
        "step": raw.get("step"),
        "pid": traj.problem_id,
        "sample": traj.sample_index,
        "problem": raw.get("problem", ""),
        "reference": raw.get("reference"),
        "answer": shown_answer(raw, traj),
        "reward": traj.reward,
        "finish": traj.finish_reason,
        "error": traj.error,
        "turns": turns,
        "note": note,
        "ncalls": traj.num_tool_calls,
        "nerr": traj.num_tool_errors,
        "forged": traj.forged_observations,  # turns that wrote a tool-response frame themselves
        "statuses": statuses,
        "len": sum(g + t for g, t in tokens),
        "gen": sum(g for g, _ in tokens),
        "prompt_len": len(traj.prompt_ids) or raw.get("prompt_tokens"),
        "p_err": pen.p_err,
        "p_format": pen.p_format,
        "p_total": pen.p_total,
        "roc": raw.get("roc"),
        "gen_s": round(traj.gen_seconds, 3),
        "tool_s": round(traj.tool_wait_seconds, 3),
    }


def has_own_turns(traj: Trajectory) -> bool:
    """Recorded with the model's own turns (every turn generated since `model_turns` existed has one)."""
    return bool(traj.model_turns) or not traj.response_text


def shown_answer(raw: dict, traj: Trajectory) -> str | None:
    """The answer column: read from the model's own turns; an older record's stored answer (its
    writer's word); never from the decoded text, where a tool's printed `<answer>` passes for one."""
    if has_own_turns(traj):
        return extract_answer(traj.model_turns)
    stored = raw.get("answer")
    return None if stored is None else str(stored)


LEGACY_NOTE = (
    "recorded before tirl kept the model's own turns: these turns are split from the decoded text, where "
    "a tool's output that prints chat markup can pass for a turn, and no answer is read from that text"
)
UNPLACED_NOTE = (
    "the tool responses could not be located between the model's turns in the decoded text: "
    "the model's own turns are shown without them"
)


def view_turns(traj: Trajectory, tokens: list[tuple[int, int]], agent: dict) -> tuple[list[dict], str]:
    """The turns the page shows (each a list of parts: text, or a tool call with its status and
    response) and a note on how far they can be trusted ("" when they are the model's own)."""
    if not has_own_turns(traj):
        return _legacy_turns(traj, tokens, agent), LEGACY_NOTE
    n = len(traj.model_turns)
    if n == 0:
        return [], ""
    prefill = _prefill(agent)
    # the token counts say whether a tool response followed the last turn (an infrastructure error
    # after it); without them, either
    trailing = tokens[n - 1][1] > 0 if len(tokens) >= n else None
    starts = place_turns(traj.response_text, traj.model_turns, prefill, trailing)
    gaps = _gaps(traj.response_text, traj.model_turns, starts)
    unused = list(traj.tool_calls)
    turns, before = [], ""
    for k, own in enumerate(traj.model_turns):
        gen, tool = tokens[k] if k < len(tokens) else (None, None)
        calls = parse_tool_calls(own, agent.get("max_calls_per_turn"), agent.get("tool_schema"))
        responses = _segment_responses(gaps[k], len(calls), prefill) if gaps[k] else []
        parts = _turn_parts(own, k, calls, responses, unused)
        if before and parts and parts[0][0] == "text":
            parts[0][1] = before + parts[0][1]
        elif before:
            parts.insert(0, ["text", before])
        turns.append({"gen": gen, "tool": tool, "parts": parts})
        before = prefill if gaps[k] else ""  # the frame's prefill, read by the model before its next turn
    return turns, "" if starts is not None else UNPLACED_NOTE


# The frame tirl writes around tool responses (tirl.agent.protocol.tool_response_pieces): after the
# model's turn (and its <|im_end|> unless the turn wrote it), the responses, then the next header.
_HEAD = "\n<|im_start|>user\n<tool_response>\n"
_BETWEEN = "\n</tool_response>\n<tool_response>\n"
_CLOSE = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def _prefill(agent: dict) -> str:
    """What the frame writes after the assistant header that follows a tool response."""
    again = agent.get("continue_prefill")
    return str(again if again is not None else agent.get("prefill", AgentConfig().prefill))


def _is_segment(text: str, start: int, stop: int, prefill: str) -> bool:
    """text[start:stop] is one tool-response segment as the frame writes it (indices, not a copy: a
    hostile record can make the placement try many candidates)."""
    if text.startswith("<|im_end|>", start, stop):
        start += len("<|im_end|>")
    closing = _CLOSE + prefill
    return (
        stop - start >= len(_HEAD) + len(closing)
        and text.startswith(_HEAD, start, stop)
        and text.endswith(closing, start, stop)
    )


_PLACE_TRIES = 100_000  # candidate segment ends examined per record: one per turn in a real record


def place_turns(text: str, turns: list[str], prefill: str, trailing: bool | None) -> list[int] | None:
    """Where each of the model's turns starts in the decoded text, each gap between two being one
    tool-response segment (and after the last one, a segment iff `trailing`; None: either); None when
    no such placement exists. Every turn is placed at the earliest start that leaves a placement for the
    rest: a tool's output comes before the turns that read it, so it can hold a later turn's text only
    by predicting it, and it never moves a turn's text, which is shown from `turns` itself."""
    if not turns or not text.startswith(turns[0]):
        return None
    failed: set[tuple[int, int]] = set()  # (turn, start) that leave no placement for the rest
    closing = _CLOSE + prefill
    tries = [_PLACE_TRIES]  # a record built to make the search long is shown unplaced instead

    def nexts(k: int, start: int) -> Iterator[int]:
        """Starts of turn k + 1 after turn k at `start`, earliest first."""
        end = start + len(turns[k])
        at = text.find(closing, end)
        while at >= 0 and tries[0] > 0:
            tries[0] -= 1
            after = at + len(closing)
            fits = (k + 1, after) not in failed and text.startswith(turns[k + 1], after)
            if fits and _is_segment(text, end, after, prefill):
                yield after
            at = text.find(closing, at + 1)

    def ends_well(start: int) -> bool:
        end = start + len(turns[-1])
        if end == len(text):
            return trailing is not True
        return trailing is not False and _is_segment(text, end, len(text), prefill)

    starts, pending = [0], [nexts(0, 0)] if len(turns) > 1 else []
    while starts:  # depth first, iteratively: a record may hold any number of turns
        k = len(starts) - 1
        if k == len(turns) - 1:
            if ends_well(starts[-1]):
                return starts
            failed.add((k, starts.pop()))
            continue
        after = next(pending[k], None)
        if after is None:
            failed.add((k, starts.pop()))
            pending.pop()
        else:
            starts.append(after)
            if k + 1 < len(turns) - 1:
                pending.append(nexts(k + 1, after))
    return None


def _gaps(text: str, turns: list[str], starts: list[int] | None) -> list[str | None]:
    """The tool-response segment after each turn (None: none, or not located)."""
    if starts is None:
        return [None] * len(turns)
    ends = [s + len(t) for s, t in zip(starts, turns, strict=True)]
    return [text[e:b] or None for e, b in zip(ends, [*starts[1:], len(text)], strict=True)]


def _segment_responses(gap: str, calls: int, prefill: str) -> list[str]:
    """The tool's text of each call in a located segment; a response that prints the frame's own
    separator splits there, but whatever it printed stays tool output."""
    head = gap.removeprefix("<|im_end|>")
    inner = head[len(_HEAD) : len(head) - len(_CLOSE + prefill)]
    return inner.split(_BETWEEN, max(calls - 1, 0))


def split_turns(traj: Trajectory, tokens: list[tuple[int, int]], agent: dict) -> list[dict]:
    """The trajectory's turns as the page shows them (view_turns, without its note)."""
    return view_turns(traj, tokens, agent)[0]


def _legacy_turns(traj: Trajectory, tokens: list[tuple[int, int]], agent: dict) -> list[dict]:
    """An old record's turns, split at the tool-response segments found in its decoded text."""
    text = traj.response_text
    turn_texts, responses, start = [], [], 0
    for m in _SEGMENT.finditer(text):
        turn_texts.append(text[start : m.start()])
        responses.append(_RESPONSE.findall(m.group(1)))
        start = m.end()
    turn_texts.append(text[start:])
    unused = list(traj.tool_calls)
    turns = []
    for k, turn_text in enumerate(turn_texts):
        gen, tool = tokens[k] if k < len(tokens) else (None, None)
        turn_responses = responses[k] if k < len(responses) else []
        calls = parse_tool_calls(turn_text, agent.get("max_calls_per_turn"), agent.get("tool_schema"))
        parts = _turn_parts(turn_text, k, calls, turn_responses, unused)
        turns.append({"gen": gen, "tool": tool, "parts": parts})
    return turns


def _turn_parts(
    text: str,
    turn: int,
    calls: list[ToolCall | ToolCallError],
    responses: list[str],
    unused: list[ToolCallRecord],
) -> list[list]:
    parts: list[list] = []
    at = 0
    for j, call in enumerate(calls):
        if call.start > at:
            parts.append(["text", text[at : call.start]])
        record = _take_record(unused, turn, call)
        shown = {
            "status": record.status if record else "not_run",
            "wall_ms": record.wall_ms if record else None,
            "response": responses[j] if j < len(responses) else None,
        }
        if isinstance(call, ToolCall):
            shown |= {"code": call_source(call), "input": call.arguments.get("input", "")}
        else:
            shown |= {
                "code": str(record.code) if record else text[call.start : call.end],
                "parse_error": call.message,
            }
        parts.append(["call", shown])
        at = max(at, call.end)
    if at < len(text):
        parts.append(["text", text[at:]])
    return parts


def _take_record(unused: list[ToolCallRecord], turn: int, call) -> ToolCallRecord | None:
    """The recorded call that matches a parsed one (records are appended as calls finish, not in order)."""
    malformed = not isinstance(call, ToolCall)
    candidates = [r for r in unused if r.turn == turn and (r.status == "malformed") == malformed]
    exact = [r for r in candidates if malformed or r.code == call_source(call)]
    record = (exact or candidates or [None])[0]
    if record is not None:
        unused.remove(record)
    return record
