"""What the viewer shows: stored trajectories (an eval's or a training run's) turned into display records.

A stored trajectory keeps the decoded response text and the loss mask, not its turns. This module
splits the text into turns at the tool-response segments the agent appends (tirl.agent.protocol),
re-parses each turn's tool calls with the agent's own parser, pairs every call with its recorded
status and its tool response, and adds RoC's penalties (tirl.rl.roc). Token ids and log-probs are
dropped: the page shows text, and 10,000 trajectories must stay a file a browser opens at once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from tirl.agent.loop import call_source
from tirl.agent.protocol import ToolCall, parse_tool_calls
from tirl.agent.trajectory import ToolCallRecord, Trajectory, turn_token_counts
from tirl.data.loaders import DataError, read_jsonl
from tirl.reward import extract_answer
from tirl.rl.roc import penalties

TRAJECTORIES = "trajectories.jsonl"

# One tool-response segment as tirl.agent.protocol.tool_response_text writes it (the prefill after it
# stays with the next turn's text, where the model reads it).
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
    trajectories = path / TRAJECTORIES
    if (path / "metrics.jsonl").exists():  # a training run
        config = _read_yaml(path / "config.yaml")
        return Source(
            "train",
            path,
            _read_jsonl(trajectories) if trajectories.exists() else [],
            curves=_read_jsonl(path / "metrics.jsonl"),
            agent=_mapping(config.get("agent")),
        )
    if not trajectories.exists():
        raise ViewError(f"{path} holds neither {TRAJECTORIES} nor metrics.jsonl ({_WHAT})")
    metrics = _read_json(path / "metrics.json")
    benchmarks = _mapping(metrics.get("benchmarks"))
    return Source(
        "eval",
        path,
        _read_jsonl(trajectories),
        summary={str(k): v for k, v in benchmarks.items() if isinstance(v, dict)},
        agent=_mapping(_mapping(metrics.get("config")).get("agent")),
    )


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
    tokens = raw.get("turn_tokens") or turn_token_counts(traj.loss_mask)
    pen = penalties(traj, (raw.get("roc") or {}).get("no_tool_p_err", 0.5))
    answer = raw["answer"] if "answer" in raw else extract_answer(traj.response_text)
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
        "answer": answer,
        "reward": traj.reward,
        "finish": traj.finish_reason,
        "error": traj.error,
        "turns": split_turns(traj, tokens, agent),
        "ncalls": traj.num_tool_calls,
        "nerr": traj.num_tool_errors,
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


def split_turns(traj: Trajectory, tokens: list[tuple[int, int]], agent: dict) -> list[dict]:
    """The trajectory's turns: each a list of parts (text, or a tool call with its status and response)."""
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
        parts = _turn_parts(turn_text, k, turn_responses, unused, agent)
        turns.append({"gen": gen, "tool": tool, "parts": parts})
    return turns


def _turn_parts(
    text: str, turn: int, responses: list[str], unused: list[ToolCallRecord], agent: dict
) -> list[list]:
    parts: list[list] = []
    at = 0
    calls = parse_tool_calls(text, agent.get("max_calls_per_turn"), agent.get("tool_schema"))
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
