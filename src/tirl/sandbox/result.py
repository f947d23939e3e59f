"""The typed result of one code execution, and the text the model sees."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Protocol


class Status(StrEnum):
    OK = "ok"
    RUNTIME_ERROR = "runtime_error"
    SYNTAX_ERROR = "syntax_error"
    TIMEOUT = "timeout"
    MEMORY_LIMIT = "memory_limit"
    OUTPUT_LIMIT = "output_limit"
    KILLED_BY_SIGNAL = "killed_by_signal"
    SANDBOX_ERROR = "sandbox_error"  # infrastructure failure: retried, never the model's fault
    QUEUE_TIMEOUT = "queue_timeout"  # infrastructure overload: retried, never the model's fault
    # timed out while other processes had the CPUs (little CPU, long waits to run): retried
    STARVED = "starved"


# The one definition of "not the model's fault": clients retry these, trainers keep them out of the loss.
INFRA_STATUSES = frozenset({Status.SANDBOX_ERROR, Status.QUEUE_TIMEOUT, Status.STARVED})


def valid_text(s: str) -> str:
    """`s` as valid UTF-8 text: lone surrogates (which no UTF-8 encoder accepts) become \\udXXX escapes."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


def _valid(value: object) -> object:
    if isinstance(value, str):
        return valid_text(value)
    if isinstance(value, dict):
        return {valid_text(str(k)): _valid(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_valid(v) for v in value]
    return value


@dataclass
class ExecResult:
    status: Status
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    wall_ms: float = 0.0
    stdout_truncated_bytes: int = 0  # bytes dropped from the middle of stdout (head + tail kept)
    stderr_truncated_bytes: int = 0
    message: str = ""  # short human-readable reason ("Timed out after 5.0 s", "killed by SIGSEGV")
    signal: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Every string leaving the sandbox must serialise: one unencodable message must not fail a
        # whole HTTP response (and with it the other results of a batch).
        self.stdout, self.stderr, self.message = (
            valid_text(t) for t in (self.stdout, self.stderr, self.message)
        )
        self.extra = _valid(self.extra)

    @property
    def ok(self) -> bool:
        return self.status == Status.OK

    @property
    def is_infra_error(self) -> bool:
        return self.status in INFRA_STATUSES

    def to_dict(self) -> dict:
        """The result as plain JSON types; each string valid again (fields may have been set after
        construction), `extra` a copy. Field by field: dataclasses.asdict's deep copy cost a fifth of
        the service's HTTP work per session cell."""
        d = {name: _valid(getattr(self, name)) for name in _FIELDS}
        d["status"] = str(self.status)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ExecResult:
        return cls(**{**d, "status": Status(d["status"])})

    def render(self, show_time: bool = True) -> str:
        """The text the model sees inside <tool_response>: output, then one typed status line.

        e.g. "42\n[ok, 12 ms]" or "Traceback ...\nZeroDivisionError: division by zero\n[runtime_error, 15 ms]"
        or "[timeout: Timed out after 5.0 s]". Host paths never appear (tracebacks are trimmed to <cell>).
        `show_time=False` leaves the run time out, so the same code always renders the same text
        (seeded rollouts then reproduce exactly, e.g. across a resume).
        """
        body = self.stdout
        if self.stderr:
            body += ("\n" if body and not body.endswith("\n") else "") + self.stderr
        notes = [self.message] if self.message and self.status not in _SELF_EXPLAINED else []
        keep = self.extra.get("keep_bytes")
        for stream, dropped in (
            ("output", self.stdout_truncated_bytes),
            ("stderr", self.stderr_truncated_bytes),
        ):
            total = self.extra.get(f"{'stdout' if stream == 'output' else 'stderr'}_bytes")
            if dropped and keep and total:
                notes.append(
                    f"{stream} truncated: first and last {human_bytes(keep)} of {human_bytes(total)} shown"
                )
        if self.extra.get("network_blocked"):
            notes.append("network access is disabled")
        parts = (
            [*notes, _duration(self.wall_ms)]
            if show_time and not self.is_infra_error and self.status != Status.TIMEOUT
            else notes
        )
        line = f"[{self.status}{': ' if notes else ', '}{'; '.join(parts)}]" if parts else f"[{self.status}]"
        return f"{body.rstrip(chr(10))}\n{line}" if body.strip() else line


_FIELDS = tuple(f.name for f in fields(ExecResult))

# errors whose traceback (already in stderr) says everything the message would
_SELF_EXPLAINED = frozenset({Status.OK, Status.RUNTIME_ERROR, Status.SYNTAX_ERROR})


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" or n >= 10 or float(n).is_integer() else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _duration(ms: float) -> str:
    return f"{ms:.0f} ms" if ms < 1000 else f"{ms / 1000:.2f} s"


class Executor(Protocol):
    """What runs code: Sandbox (in-process pool), SandboxClient (HTTP), or anything alike."""

    async def run(self, code: str, stdin: str = "", timeout: float | None = None) -> ExecResult: ...
