"""The pool's one admission rule: what may queue, and what memory it may hold, for calls and sessions.

Stateless calls (pool.py) and persistent sessions (session_manager.py) ask this one object, so a
budget rule is written once. It answers before anything waits:

- the queue: a pool that is closed, or `max_queue` calls and session cells already waiting, refuses
  at once;
- the session cap: sessions held (live, opening or closing) never exceed `max_sessions`;
- the memory budget (`budget_mb`, default the machine's RAM): a running call holds its `memory_mb`
  while it runs. A session holds its `memory_mb` while it opens and while a cell of it runs, and
  between cells only what it really uses (measured when it goes idle: frozen, it cannot grow), so
  idle sessions hold what they occupy, not what they could: before, five idle sessions using 34 MiB
  held 22,032 MiB and every other client's open got 429 for as long as they lived. Sessions
  together may hold at most the budget minus `calls_reserve_mb`: that share is kept for stateless
  calls, so however many sessions sit idle, calls still run. A call may use what sessions leave free.
"""

from __future__ import annotations

from dataclasses import dataclass

from tirl.sandbox.result import ExecResult, Status


class SessionError(RuntimeError):
    """A session could not be opened (cap reached, pool closed or overloaded)."""


def default_calls_reserve_mb(budget_mb: int, slots: int, call_memory_mb: int) -> int:
    """Every slot running a call at the default memory limit, but never more than half the budget."""
    return min(budget_mb // 2, slots * call_memory_mb)


@dataclass
class Admission:
    """Counters of what is waiting and what is held, and the rule that admits more."""

    max_queue: int
    max_sessions: int
    budget_mb: int
    calls_reserve_mb: int
    closed: bool = False
    waiting: int = 0  # calls and session cells waiting (for a slot, or for their session)
    sessions_held: int = 0  # live, opening or closing
    calls_mb: int = 0  # memory held by running calls
    sessions_mb: int = 0  # memory held by live sessions

    def __post_init__(self) -> None:
        if not 0 <= self.calls_reserve_mb <= self.budget_mb:
            raise ValueError(
                f"calls_reserve_mb={self.calls_reserve_mb} must lie between 0 and the memory budget "
                f"({self.budget_mb} MiB)"
            )

    @property
    def reserved_mb(self) -> int:
        return self.calls_mb + self.sessions_mb

    @property
    def sessions_share_mb(self) -> int:
        """The most sessions may hold together: the budget less the share kept for calls."""
        return self.budget_mb - self.calls_reserve_mb

    def queue_refusal(self) -> ExecResult | None:
        """Why a call or cell cannot even queue (closed pool, queue full), or None."""
        if self.closed:
            return ExecResult(Status.SANDBOX_ERROR, message="the sandbox pool is closed")
        if self.waiting >= self.max_queue:
            return ExecResult(
                Status.QUEUE_TIMEOUT,
                message=f"queue full ({self.max_queue} calls and session cells waiting)",
            )
        return None

    def reserve_call(self, memory_mb: int) -> str | None:
        """Hold `memory_mb` for a running call, or say why not (whatever sessions leave free)."""
        if self.reserved_mb + memory_mb > self.budget_mb:
            return (
                f"memory budget: {self.reserved_mb} of {self.budget_mb} MiB are held by running calls "
                f"({self.calls_mb} MiB) and live sessions ({self.sessions_mb} MiB), {memory_mb} MiB more "
                f"do not fit (retry later or ask for less memory)"
            )
        self.calls_mb += memory_mb
        return None

    def release_call(self, memory_mb: int) -> None:
        self.calls_mb -= memory_mb

    def admit_session(self, memory_mb: int) -> None:
        """Count a new session against the cap and the sessions' share; raises SessionError if not."""
        if self.closed:
            raise SessionError("the sandbox pool is closed")
        if self.sessions_held >= self.max_sessions:
            raise SessionError(
                f"{self.max_sessions} sessions are live or opening (the cap): close some, or wait for idle "
                f"ones to expire"
            )
        if self.sessions_mb + memory_mb > self.sessions_share_mb:
            raise SessionError(
                f"memory budget: sessions hold {self.sessions_mb} of the {self.sessions_share_mb} MiB they "
                f"may share ({self.calls_reserve_mb} of {self.budget_mb} MiB are kept for stateless calls), "
                f"{memory_mb} MiB more do not fit (close idle sessions, or ask for less memory)"
            )
        if self.reserved_mb + memory_mb > self.budget_mb:
            raise SessionError(
                f"memory budget: {self.reserved_mb} of {self.budget_mb} MiB are held by running calls and "
                f"live sessions, {memory_mb} MiB more do not fit (retry later, or ask for less memory)"
            )
        self.sessions_held += 1
        self.sessions_mb += memory_mb

    def resize_session(self, held_mb: int, memory_mb: int) -> str | None:
        """A session's holding from `held_mb` to `memory_mb` (its limit before a cell, its use after),
        or why it cannot grow (it keeps `held_mb` then). Shrinking always succeeds."""
        more = memory_mb - held_mb
        if more > 0 and self.sessions_mb + more > self.sessions_share_mb:
            return (
                f"memory budget: sessions hold {self.sessions_mb} of the {self.sessions_share_mb} MiB they may "
                f"share, this cell needs {more} MiB more (its session's limit): retry later"
            )
        if more > 0 and self.reserved_mb + more > self.budget_mb:
            return (
                f"memory budget: {self.reserved_mb} of {self.budget_mb} MiB are held by running calls and "
                f"sessions, this cell needs {more} MiB more (its session's limit): retry later"
            )
        self.sessions_mb += more
        return None

    def release_session(self, memory_mb: int) -> None:
        self.sessions_held -= 1
        self.sessions_mb -= memory_mb
