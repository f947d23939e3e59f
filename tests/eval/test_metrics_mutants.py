"""Edges of the evaluation metrics (tirl.eval.metrics): the checks of pass@k's arguments, clustering
that asks the verifier only when needed, majority ties, what counts as correct, and every aggregate
of benchmark_metrics on unequal groups; see docs/mutation.md."""

from __future__ import annotations

import pytest

from tirl.agent.trajectory import ToolCallRecord, Trajectory
from tirl.eval.metrics import (
    BenchmarkMetrics,
    ProblemResult,
    benchmark_metrics,
    cluster_answers,
    majority_vote,
    pass_at_k,
    pass_k_values,
)


@pytest.mark.parametrize(("n", "c", "k"), [(4, -1, 1), (4, 5, 1), (4, 1, 0), (4, 1, 5), (0, 0, 1)])
def test_pass_at_k_rejects_each_bad_argument(n, c, k):
    with pytest.raises(ValueError) as err:
        pass_at_k(n, c, k)
    assert str(err.value) == f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}"


def test_pass_at_k_at_its_edges():
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(5, 2, 4) == 1.0  # n - c < k: every k-subset holds a correct sample
    assert pass_at_k(5, 1, 4) == pytest.approx(1 - 1 / 5)


def test_pass_at_k_when_n_minus_c_equals_k():
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)


def test_pass_k_values_are_powers_of_two_and_n():
    assert pass_k_values(8) == [1, 2, 4, 8]
    assert pass_k_values(9) == [1, 2, 4, 8, 9]
    assert pass_k_values(2) == [1, 2] and pass_k_values(3) == [1, 2, 3]


async def test_cluster_answers_asks_the_verifier_only_for_new_texts():
    asked = []

    async def same(a, b):
        asked.append((a, b))
        return a.replace(" ", "") == b.replace(" ", "")

    labels = await cluster_answers(["1", " 1 ", "2", None, "1  +1", "1 +1", "2", "3"], same)
    assert labels == [0, 0, 1, -1, 2, 2, 1, 3]
    # "1 +1" joins class 2 by its whitespace-normalized text, without asking; "3" is asked against each
    assert asked == [("2", "1"), ("1  +1", "1"), ("1  +1", "2"), ("3", "1"), ("3", "2"), ("3", "1  +1")]
    assert await cluster_answers([], same) == [] and await cluster_answers([None], same) == [-1]


async def test_cluster_answers_takes_the_first_matching_class():
    async def same(a, b):
        return True

    assert await cluster_answers(["a", "b", "c"], same) == [0, 0, 0]


def test_majority_vote_ties_and_the_index_returned():
    assert majority_vote([-1, 3, 2, 2, 3]) == 1  # tie 2-2: class 3 is seen first, at index 1
    assert majority_vote([-1, -1, 0]) == 2
    assert majority_vote([]) is None
    assert majority_vote([1, 0, 0]) == 1


def test_correct_means_a_positive_reward():
    r = ProblemResult("p", "1", rewards=[1.0, 0.0, -1.0, 0.5], answers=["1", "2", None, "1"])
    assert r.correct == 2 and not r.majority_correct
    assert ProblemResult("p", "1", [0.0, 1.0], ["a", "b"], majority=1).majority_correct
    assert not ProblemResult("p", "1", [0.0, 1.0], ["a", "b"], majority=0).majority_correct
    assert r.problem == ""


def _traj(n_tokens, generated, calls, finish="answered", turns=1):
    return Trajectory(
        problem_id="p",
        prompt_ids=[1],
        response_ids=[5] * n_tokens,
        loss_mask=[1] * generated + [0] * (n_tokens - generated),
        turns=turns,
        tool_calls=[ToolCallRecord(turn=0, status=s) for s in calls],
        finish_reason=finish,
    )


def test_benchmark_metrics_on_unequal_groups():
    results = [
        ProblemResult("a", "1", rewards=[1.0, 0.0, 1.0], answers=["1", None, "1"], majority=0),
        ProblemResult("b", "2", rewards=[0.0, 1.0], answers=["3", "2"], majority=0),
    ]
    trajs = [
        [_traj(4, 3, ["ok"], turns=2), _traj(6, 6, [], "length"), _traj(2, 1, ["ok", "timeout"], turns=3)],
        [_traj(8, 2, [], "length", turns=1), _traj(10, 8, ["runtime_error"], turns=2)],
    ]
    m = benchmark_metrics("toy", results, trajs)
    assert isinstance(m, BenchmarkMetrics) and m.name == "toy"
    assert (m.problems, m.samples) == (2, 2)  # k: the smallest group
    assert m.pass1 == pytest.approx((2 / 3 + 1 / 2) / 2)
    assert m.pass_at == pytest.approx({1: (2 / 3 + 1 / 2) / 2, 2: (1.0 + 1.0) / 2})
    assert m.maj == 0.5
    assert m.mean_response_tokens == 6.0 and m.mean_generated_tokens == 4.0 and m.mean_turns == 1.8
    assert m.tool_calls_per_trajectory == pytest.approx(4 / 5) and m.tool_error_rate == 0.5
    assert m.no_answer_rate == pytest.approx(1 / 5)
    assert list(m.finish_reasons.items()) == [("answered", 3), ("length", 2)]


def test_finish_reasons_are_listed_most_common_first():
    trajs = [[_traj(1, 1, [], "length"), _traj(1, 1, [], "answered"), _traj(1, 1, [], "length")]]
    results = [ProblemResult("a", "1", [0.0, 0.0, 0.0], [None, None, None])]
    m = benchmark_metrics("t", results, trajs)
    assert list(m.finish_reasons.items()) == [("length", 2), ("answered", 1)]
    assert m.tool_error_rate is None and m.maj == 0.0 and m.no_answer_rate == 1.0


def test_an_empty_benchmark_has_zero_metrics():
    empty = BenchmarkMetrics(name="e", problems=0, samples=0, pass1=0.0)
    assert benchmark_metrics("e", [], []) == empty
    assert benchmark_metrics("e", [ProblemResult("a", "1", [1.0], ["1"])], [[]]) == BenchmarkMetrics(
        name="e", problems=1, samples=0, pass1=0.0
    )
    assert empty.to_dict()["pass_at"] == {} and empty.tool_error_rate is None
