"""Answer equivalence with HuggingFace math-verify, plus the binary answer-only reward.

math-verify guards itself with SIGALRM, which only works in a main thread and cannot stop C code; tirl
switches that off and applies its own deadline here (`deadline`) and, in tirl.reward.pool, a hard one
(the worker process is killed).
"""

from __future__ import annotations

import logging
import re
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache

from math_verify import parse, verify

from tirl.reward.extract import extract_answer

# math-verify warns once that its own timeout is disabled, and on every timeout: both are handled here.
logging.getLogger("math_verify").setLevel(logging.ERROR)

MAX_ANSWER_CHARS = 1000
_PLAIN_INTEGER = re.compile(r"[+-]?(?:\d+|\d{1,3}(?:,\d{3})+)")


class VerifyTimeout(BaseException):
    """Raised inside a verification that ran past its deadline (BaseException: math-verify catches Exception)."""


@contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Interrupt Python-level work after `seconds` with VerifyTimeout (main thread only; else no limit)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise VerifyTimeout(f"verification exceeded {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def as_integer(text: str) -> int | None:
    """The integer a plain answer spells ("025", "-3", "1,000"), else None."""
    text = text.strip().strip("$").strip()
    if not _PLAIN_INTEGER.fullmatch(text):
        return None
    return int(text.replace(",", ""))


def quick_verdict(answer: str, reference: str) -> bool | None:
    """Decide cheaply when both sides are plain integers (most training data) or the answer is absurdly
    long (a degenerate generation: spare the verifier); None = needs math-verify."""
    if len(answer) > max(MAX_ANSWER_CHARS, 4 * len(reference)):
        return False
    a, r = as_integer(answer), as_integer(reference)
    if a is None or r is None:
        return None
    return a == r


def equivalent(answer: str, reference: str) -> bool:
    """Is `answer` (a boxed expression's content) mathematically equal to `reference`? No time limit."""
    verdict = quick_verdict(answer, reference)
    if verdict is not None:
        return verdict
    gold, pred = _parse(reference), _parse(answer)
    return bool(gold and pred and verify(list(gold), list(pred), timeout_seconds=None))


@lru_cache(maxsize=4096)
def _parse(expression: str) -> tuple:
    """math-verify's parse of one boxed expression, cached: the k samples of a problem share their
    reference and often their answer."""
    return tuple(parse("\\boxed{" + expression + "}", parsing_timeout=None))


def score(response: str | Sequence[str], reference: str, timeout: float | None = 5.0) -> float:
    """Binary answer-only reward: 1.0 if the response's final boxed answer equals `reference`, else 0.0.
    `response`: the model's own turns (Trajectory.model_turns), never text a tool wrote.

    In-process; `timeout` interrupts slow verification only in the main thread. For batches, untrusted
    output, or threads, use tirl.reward.RewardPool (separate processes, hard kill).
    """
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    try:
        with deadline(timeout):
            return float(equivalent(answer, reference))
    except VerifyTimeout:
        return 0.0
