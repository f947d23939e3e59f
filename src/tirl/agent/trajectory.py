"""One multi-turn trajectory in token space, plus what RoC and the metrics need."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Literal

# What RoC and the metrics read from a tool call (tirl.agent.tools.ToolResult.status).
ToolCallStatus = Literal["ok", "runtime_error", "timeout", "malformed", "sandbox_error", "other_error"]
# The tool's infrastructure failed (sandbox down, queue full after retries): never the model's fault.
INFRA_TOOL_STATUSES: frozenset[str] = frozenset({"sandbox_error"})
# answered: the last turn made no tool call and gave an <answer>; no_answer: it made no call and gave
# none; max_turns / length: a budget ended it; error: the engine or a tool's infrastructure failed.
TrajectoryFinish = Literal["answered", "no_answer", "max_turns", "length", "error"]
# Finish reasons that keep reward 0 without asking the verifier: cut at the length budget (the paper keeps
# truncated trajectories at 0; overlong filtering hurt) or ended by an infrastructure error.
UNSCORED_FINISH: frozenset[str] = frozenset({"length", "error"})


@dataclass
class ToolCallRecord:
    turn: int
    status: ToolCallStatus
    code: str = ""  # the call's `code` argument, else its JSON arguments (malformed: the raw text)
    wall_ms: float = 0.0
    tool: str = ""  # the tool's name ("" for a malformed call)

    @property
    def infra_failed(self) -> bool:
        return self.status in INFRA_TOOL_STATUSES

    @property
    def errored(self) -> bool:
        """An errored call for RoC's p_err: failed execution, timeout, or malformed call, of any tool.

        Infrastructure failures are not the model's fault and never count against it."""
        return self.status != "ok" and not self.infra_failed


@dataclass
class Trajectory:
    problem_id: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)  # generated + tool-response tokens, in order
    loss_mask: list[int] = field(default_factory=list)  # 1 for generated tokens, 0 for tool responses
    logprobs: list[float] = field(
        default_factory=list
    )  # sampling logprob per response token (0.0 where masked)
    # Policy version per response token (tirl.engines.versions): the weights that generated it; a tool
    # response carries the version of the turn that called the tool.
    versions: list[int] = field(default_factory=list)
    response_text: str = ""  # all of the response decoded, for inspection only; never re-encoded
    # Each run of generated tokens (loss mask 1), decoded on its own: the model's own text, the only
    # text its answer is read from (a tool's output can print anything, an answer included).
    model_turns: list[str] = field(default_factory=list)
    turns: int = 0
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    answer_blocks: int = 0
    # Model turns that wrote a tool-response frame themselves, a made-up observation (cut there when
    # agent.stop_at_forged_observation; tirl.agent.protocol.forged_frame_at).
    forged_observations: int = 0
    finish_reason: TrajectoryFinish = "answered"
    error: str = ""
    reward: float = 0.0
    gen_seconds: float = 0.0
    tool_wait_seconds: float = 0.0
    engine: str = ""
    sample_index: int = 0

    @property
    def failed(self) -> bool:
        """An infrastructure failure (engine or sandbox) ended it: it says nothing about the policy, so it
        is never a RoC candidate nor trained on, but it counts in the metrics."""
        return self.finish_reason == "error"

    @property
    def scored(self) -> bool:
        """Its reward comes from the verifier (else it keeps 0: UNSCORED_FINISH)."""
        return self.finish_reason not in UNSCORED_FINISH

    @property
    def num_tool_calls(self) -> int:
        return len(self.tool_calls)

    @property
    def num_tool_errors(self) -> int:
        return sum(c.errored for c in self.tool_calls)

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version among its generated tokens (None: it generated nothing)."""
        return min((v for v, m in zip(self.versions, self.loss_mask, strict=True) if m), default=None)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Trajectory:
        """The inverse of to_dict; keys that are not fields (a JSONL record's extras) are ignored, and
        a compact record without token ids (training's trajectory samples) gets empty ones."""
        known = {f.name for f in fields(cls)} - {"tool_calls"}
        calls = [ToolCallRecord(**c) for c in d.get("tool_calls", [])]
        return cls(**{"prompt_ids": [], **{k: v for k, v in d.items() if k in known}}, tool_calls=calls)


def generated_runs(response_ids: Sequence[int], loss_mask: Sequence[int]) -> list[list[int]]:
    """The runs of generated tokens (loss mask 1) in order, one per turn: what `model_turns` decodes."""
    runs: list[list[int]] = []
    previous = 0
    for token, m in zip(response_ids, loss_mask, strict=True):
        if m and not previous:
            runs.append([])
        if m:
            runs[-1].append(token)
        previous = m
    return runs


def turn_token_counts(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """(generated, tool-response) token counts of each turn, read from the loss mask's runs."""
    counts: list[list[int]] = []
    previous = 0
    for m in loss_mask:
        if m and not previous:
            counts.append([0, 0])
        if counts:
            counts[-1][0 if m else 1] += 1
        previous = m
    return [(g, t) for g, t in counts]


def tool_error_ratio(trajectories: Iterable[Trajectory]) -> float | None:
    """Errored tool calls / tool calls over `trajectories` (the paper's p_err, pooled); None when they
    made no tool call at all: n/a, not 0 (a step with no correct trajectory has no Figure-4 value)."""
    calls = errors = 0
    for t in trajectories:
        calls += t.num_tool_calls
        errors += t.num_tool_errors
    return errors / calls if calls else None
