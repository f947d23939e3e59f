"""Synthetic tasks for the tiny CPU demo: easy with Python, hopeless in a tiny model's head.

Each task family turns a few random integers below 1000 into a problem statement, the Python code that
solves it and an integer answer that is (almost always) below 1000 too: with the demo preset's tokenizer
every such number is one token, so copying it into code and out of the tool's output is one token per
number (tirl.tiny_model). The code only COPIES numbers from the statement (no mental arithmetic such as
`n + 1`), so a tiny model can learn to write it, while guessing the answer without running it fails.

Two families make the paper's noisy-success regime exist (see tirl.demo.sft_traces for the errors):
  - sum_big: the obvious brute force (a loop over hundreds of millions) TIMES OUT; only the
    closed form runs in time, the tiny-scale stand-in for slow brute-force code in competition math;
  - last_digit: the last digit of b^e in a small base has 3-7 possible values, so a guess without the
    tool is right by luck 14-33% of the time: outcome-only reward credits it like a real solution.
`answer_range` says where a guess lands (the whole small base for last_digit; numbers of the answer's
size otherwise, which are almost never right).

The split is a property of the problem, not of the seed: a problem is held out when a hash of its
text falls in the held-out bucket, so the training and held-out sets are disjoint by construction.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tirl.data.problem import Problem

HELDOUT_BUCKETS = 8  # 1 problem in 8 belongs to the held-out split
SOURCE = "tirl-synthetic"


@dataclass(frozen=True)
class TaskFamily:
    """One kind of problem: parameters -> (statement, solving code, answer)."""

    name: str
    sample: Callable[[random.Random], dict[str, int]]
    phrasings: tuple[str, ...]  # str.format templates over the parameters
    code: str  # str.format template: Python that prints the answer
    solve: Callable[..., int]  # the answer computed directly (checked against the code in tests)
    brute_force: str = ""  # str.format template: an obvious first attempt that times out
    answer_range: Callable[..., range] | None = None  # where a guess without the tool lands


def _is_prime(k: int) -> bool:
    return k > 1 and all(k % d for d in range(2, math.isqrt(k) + 1))


FAMILIES: tuple[TaskFamily, ...] = (
    TaskFamily(
        name="product_mod",
        sample=lambda r: {"a": r.randint(100, 999), "b": r.randint(100, 999), "m": r.randint(101, 999)},
        phrasings=(
            "What is {a} times {b} modulo {m}?",
            "Find the remainder when the product of {a} and {b} is divided by {m}.",
        ),
        code="print({a} * {b} % {m})",
        solve=lambda a, b, m: a * b % m,
    ),
    TaskFamily(
        name="power_mod",
        sample=lambda r: {"b": r.randint(3, 99), "e": r.randint(20, 999), "m": r.randint(101, 999)},
        phrasings=(
            "Find the remainder when {b} to the power {e} is divided by {m}.",
            "What is {b}^{e} modulo {m}?",
        ),
        code="print(pow({b}, {e}, {m}))",
        solve=lambda b, e, m: pow(b, e, m),
    ),
    TaskFamily(
        name="count_divisible",
        sample=lambda r: {"n": r.randint(100, 999), "p": r.randint(3, 19), "q": r.randint(21, 49)},
        phrasings=(
            "How many integers from 1 to {n} inclusive are divisible by {p} or by {q}?",
            "Count the integers between 1 and {n} inclusive that are multiples of {p} or {q}.",
        ),
        code="print(sum(1 for k in range(1, {n} + 1) if k % {p} == 0 or k % {q} == 0))",
        solve=lambda n, p, q: n // p + n // q - n // math.lcm(p, q),
    ),
    TaskFamily(
        name="sum_powers_mod",
        sample=lambda r: {"e": r.randint(2, 3), "n": r.randint(10, 399), "m": r.randint(101, 999)},
        phrasings=(
            "What is the sum of k^{e} for k from 1 to {n}, modulo {m}?",
            "Compute 1^{e} + 2^{e} + ... + {n}^{e} modulo {m}.",
        ),
        code="print(sum(k ** {e} for k in range(1, {n} + 1)) % {m})",
        solve=lambda e, n, m: sum(k**e for k in range(1, n + 1)) % m,
    ),
    TaskFamily(
        name="digit_sum",
        sample=lambda r: {"b": r.randint(3, 99), "e": r.randint(20, 60)},
        phrasings=(
            "What is the sum of the digits of {b}^{e}?",
            "Find the digit sum of {b} to the power {e}.",
        ),
        code="print(sum(int(d) for d in str({b} ** {e})))",
        solve=lambda b, e: sum(int(d) for d in str(b**e)),
    ),
    TaskFamily(
        name="prime_count",
        sample=lambda r: {"n": r.randint(100, 999)},
        phrasings=("How many primes are less than {n}?", "Count the prime numbers below {n}."),
        code="print(sum(1 for k in range(2, {n}) if all(k % d for d in range(2, int(k ** 0.5) + 1))))",
        solve=lambda n: sum(_is_prime(k) for k in range(2, n)),
    ),
    TaskFamily(
        name="sum_big",
        sample=lambda r: {"n": r.randint(200, 999), "m": r.randint(101, 999)},
        phrasings=(
            "What is 1 + 2 + ... + {n} million, modulo {m}?",
            "Find the sum of all integers from 1 to {n} million, modulo {m}.",
        ),
        code="N = {n} * 10**6\nprint(N * (N + 1) // 2 % {m})",
        solve=lambda n, m: (n * 10**6) * (n * 10**6 + 1) // 2 % m,
        # A Python-level loop (>= ~30 ns a step on any CPU): hundreds of millions of steps time out
        # with a wide margin; `sum(range(...))` runs in C and can finish in 2-3 s on an idle core.
        brute_force="total = 0\nfor k in range(1, {n} * 10**6 + 1):\n    total += k\nprint(total % {m})",
    ),
    TaskFamily(
        name="last_digit",
        sample=lambda r: {"b": r.randint(11, 99), "e": r.randint(20, 999), "m": r.randint(3, 7)},
        phrasings=(
            "What is the last digit of {b}^{e} written in base {m}?",
            "Find the last base-{m} digit of {b} to the power {e}.",
        ),
        code="print(pow({b}, {e}, {m}))",
        solve=lambda b, e, m: pow(b, e, m),
        answer_range=lambda b, e, m: range(m),
    ),
)
FAMILY_BY_NAME = {f.name: f for f in FAMILIES}


def is_heldout(text: str) -> bool:
    digest = hashlib.sha256(text.encode()).digest()
    return digest[0] % HELDOUT_BUCKETS == 0


def make_problem(family: TaskFamily, rng: random.Random) -> Problem:
    params = family.sample(rng)
    text = rng.choice(family.phrasings).format(**params)
    pid = "syn-" + hashlib.sha256(text.encode()).hexdigest()[:12]
    return Problem(
        id=pid,
        problem=text,
        answer=str(family.solve(**params)),
        source=SOURCE,
        meta={"family": family.name, "params": params, "code": family.code.format(**params)}
        | ({"brute_force": family.brute_force.format(**params)} if family.brute_force else {}),
    )


def generate(
    n: int,
    split: str = "train",
    seed: int = 0,
    families: list[str] | None = None,
) -> list[Problem]:
    """`n` distinct problems of `split` ("train" or "heldout"), families in round-robin order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}: use 'train' or 'heldout'")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    chosen = list(FAMILIES) if families is None else [_family(name) for name in families]
    if not chosen:
        raise ValueError("families is empty: give at least one of " + ", ".join(FAMILY_BY_NAME))
    rng = random.Random(f"{split}-{seed}")
    problems: list[Problem] = []
    seen: set[str] = set()
    attempts = 0
    while len(problems) < n:
        attempts += 1
        if attempts > 100 * n + 1000:
            raise RuntimeError(f"could not draw {n} distinct {split} problems; ask for fewer")
        family = chosen[len(problems) % len(chosen)]
        problem = make_problem(family, rng)
        if is_heldout(problem.problem) != (split == "heldout") or problem.problem in seen:
            continue
        seen.add(problem.problem)
        problems.append(problem)
    return problems


def guess_range(problem: Problem) -> range:
    """Where a guess without the tool lands: the family's answer range, else numbers of the answer's size."""
    family = FAMILY_BY_NAME.get(problem.meta.get("family", ""))
    if family is not None and family.answer_range is not None:
        return family.answer_range(**problem.meta["params"])
    n = len(problem.answer.lstrip("-"))
    return range(10 ** (n - 1) if n > 1 else 0, 10**n)


def _family(name: str) -> TaskFamily:
    if name not in FAMILY_BY_NAME:
        raise ValueError(f"unknown task family {name!r}; choose from {', '.join(FAMILY_BY_NAME)}")
    return FAMILY_BY_NAME[name]


def write_jsonl(problems: list[Problem], path: str | Path) -> Path:
    """Write problems in the loader's JSONL schema (id, problem, answer, source + family)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for p in problems:
            row = {"id": p.id, "problem": p.problem, "answer": p.answer, "source": p.source, **p.meta}
            f.write(json.dumps(row) + "\n")
    return path
