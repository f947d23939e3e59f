"""Evaluation metrics as pure functions: avg@k pass@1 (the paper's), unbiased pass@k, maj@k, tool stats."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field

from tirl.agent.trajectory import Trajectory, tool_error_ratio


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_k_values(n: int) -> list[int]:
    """The k reported for n samples: powers of two up to n, and n itself."""
    ks = {1 << i for i in range(n.bit_length()) if 1 << i <= n}
    return sorted(ks | {n})


async def cluster_answers(
    answers: Sequence[str | None], same: Callable[[str, str], Awaitable[bool]]
) -> list[int]:
    """Group answers into equivalence classes: one label per answer (-1: no answer). `same` is the
    verifier; answers equal up to whitespace join a class without asking it."""
    classes: dict[str, int] = {}  # whitespace-normalized answer -> label
    representatives: list[str] = []
    labels = []
    for answer in answers:
        if answer is None:
            labels.append(-1)
            continue
        key = " ".join(answer.split())
        if key not in classes:
            classes[key] = await _find_class(answer, representatives, same)
        labels.append(classes[key])
    return labels


async def _find_class(answer: str, representatives: list[str], same) -> int:
    for label, rep in enumerate(representatives):
        if await same(answer, rep):
            return label
    representatives.append(answer)
    return len(representatives) - 1


def majority_vote(labels: Sequence[int]) -> int | None:
    """Index of a sample in the largest answer class (ties: the class seen first); None if no answers."""
    counts = Counter(label for label in labels if label >= 0)
    if not counts:
        return None
    best = max(counts.values())
    winner = next(label for label in labels if label >= 0 and counts[label] == best)
    return labels.index(winner)


@dataclass
class ProblemResult:
    """One problem's k samples after scoring."""

    problem_id: str
    reference: str
    rewards: list[float]
    answers: list[str | None]
    majority: int | None = None  # index of the majority-vote sample
    problem: str = ""  # the problem's text (written with each trajectory, for `tirl view`)

    @property
    def correct(self) -> int:
        return int(sum(r > 0 for r in self.rewards))

    @property
    def majority_correct(self) -> bool:
        return self.majority is not None and self.rewards[self.majority] > 0


@dataclass
class BenchmarkMetrics:
    name: str
    problems: int
    samples: int  # k, samples per problem
    pass1: float  # avg@k pass@1: mean accuracy over all samples (the paper's metric)
    pass_at: dict[int, float] = field(default_factory=dict)  # unbiased pass@k
    maj: float = 0.0  # maj@k: majority answer correct
    mean_response_tokens: float = 0.0  # generated + tool-response tokens
    mean_generated_tokens: float = 0.0  # tokens the model wrote
    mean_turns: float = 0.0
    tool_calls_per_trajectory: float = 0.0
    tool_error_rate: float | None = None  # errored calls / calls (p_err over the benchmark); None: no calls
    no_answer_rate: float = 0.0
    finish_reasons: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def benchmark_metrics(
    name: str, results: Sequence[ProblemResult], trajectories: Sequence[Sequence[Trajectory]]
) -> BenchmarkMetrics:
    """Aggregate one benchmark: results[i] and trajectories[i] describe problem i."""
    flat = [t for group in trajectories for t in group]
    if not results or not flat:
        return BenchmarkMetrics(name=name, problems=len(results), samples=0, pass1=0.0)
    k = min(len(r.rewards) for r in results)
    calls = sum(t.num_tool_calls for t in flat)
    return BenchmarkMetrics(
        name=name,
        problems=len(results),
        samples=k,
        pass1=_mean(r.correct / len(r.rewards) for r in results),
        pass_at={
            kk: _mean(pass_at_k(len(r.rewards), r.correct, kk) for r in results) for kk in pass_k_values(k)
        },
        maj=_mean(float(r.majority_correct) for r in results),
        mean_response_tokens=_mean(t.response_length for t in flat),
        mean_generated_tokens=_mean(sum(t.loss_mask) for t in flat),
        mean_turns=_mean(t.turns for t in flat),
        tool_calls_per_trajectory=calls / len(flat),
        tool_error_rate=tool_error_ratio(flat),
        no_answer_rate=_mean(float(a is None) for r in results for a in r.answers),
        finish_reasons=dict(Counter(t.finish_reason for t in flat).most_common()),
    )


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
