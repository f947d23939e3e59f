"""Evaluation metrics and reports on hand-built trajectories (pure functions, real math-verify), and
the metrics' edges (see docs/mutation.md)."""

import itertools
import json
import math

import pytest

from tirl.agent.trajectory import ToolCallRecord, Trajectory
from tirl.eval import (
    BenchmarkResult,
    EvalConfig,
    EvalReport,
    ProblemResult,
    benchmark_metrics,
    cluster_answers,
    majority_vote,
    pass_at_k,
)
from tirl.eval.metrics import BenchmarkMetrics, pass_k_values
from tirl.reward import RewardStats, equivalent


@pytest.mark.parametrize(("n", "c"), [(4, 0), (4, 1), (5, 2), (6, 6), (8, 3)])
def test_pass_at_k_matches_enumeration(n, c):
    outcomes = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(outcomes, k))
        expected = sum(any(s) for s in subsets) / len(subsets)
        assert math.isclose(pass_at_k(n, c, k), expected)
    assert math.isclose(pass_at_k(n, c, 1), c / n)


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)


def test_pass_k_values():
    assert pass_k_values(16) == [1, 2, 4, 8, 16]
    assert pass_k_values(6) == [1, 2, 4, 6]
    assert pass_k_values(1) == [1]


async def _same(a, b):
    return equivalent(a, b)


async def test_cluster_answers_is_equivalence_aware():
    answers = ["\\frac{1}{2}", "0.5", None, "3", "\\dfrac12", "03", "x"]
    assert await cluster_answers(answers, _same) == [0, 0, -1, 1, 0, 1, 2]


def test_majority_vote():
    assert majority_vote([0, 1, 1, -1, 0, 1]) == 1  # class 1 (3 votes): its first sample
    assert majority_vote([2, 0, 0, 2]) == 0  # tie: the class seen first wins
    assert majority_vote([-1, -1]) is None


def _traj(pid, j, n_tokens, generated, calls, finish="answered", reward=0.0):
    return Trajectory(
        problem_id=pid,
        prompt_ids=[1, 2],
        response_ids=[5] * n_tokens,
        loss_mask=[1] * generated + [0] * (n_tokens - generated),
        turns=len(calls) + 1,
        tool_calls=[ToolCallRecord(turn=i, status=s) for i, s in enumerate(calls)],
        finish_reason=finish,
        reward=reward,
        sample_index=j,
    )


def _bench():
    trajs = [
        [
            _traj("p1", 0, 10, 8, ["ok"], reward=1.0),
            _traj("p1", 1, 20, 10, ["ok", "runtime_error"], reward=1.0),
        ],
        [_traj("p2", 0, 30, 30, []), _traj("p2", 1, 40, 20, ["timeout"], finish="length")],
    ]
    results = [
        ProblemResult("p1", "5", rewards=[1.0, 1.0], answers=["5", "5"], majority=0),
        ProblemResult("p2", "7", rewards=[0.0, 0.0], answers=["6", None], majority=0),
    ]
    return results, trajs


def test_benchmark_metrics():
    results, trajs = _bench()
    m = benchmark_metrics("toy", results, trajs)
    assert (m.problems, m.samples) == (2, 2)
    assert m.pass1 == 0.5 and m.pass_at == {1: 0.5, 2: 0.5} and m.maj == 0.5
    assert m.mean_response_tokens == 25 and m.mean_generated_tokens == 17
    assert m.tool_calls_per_trajectory == 1.0 and m.tool_error_rate == 0.5
    assert m.no_answer_rate == 0.25 and m.mean_turns == 2.0
    assert m.finish_reasons == {"answered": 3, "length": 1}


def test_report_files(tmp_path):
    results, trajs = _bench()
    bench = BenchmarkResult(benchmark_metrics("toy", results, trajs), results, trajs)
    report = EvalReport({"toy": bench}, config=EvalConfig(samples=2).model_dump(exclude={"agent"}))
    out = report.write(tmp_path / "run")
    md = (out / "report.md").read_text()
    assert "| toy | 2 | 50.0 | 50.0 | 50.0 |" in md
    assert "avg@2 pass@1" in md and "samples: `2`" in md
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["benchmarks"]["toy"]["pass1"] == 0.5
    lines = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert [(r["problem_id"], r["sample_index"], r["answer"]) for r in lines] == [
        ("p1", 0, "5"),
        ("p1", 1, "5"),
        ("p2", 0, "6"),
        ("p2", 1, None),
    ]
    assert lines[0]["majority"] and not lines[1]["majority"]
    assert EvalReport.read(out) == report  # what a resumed demo reports from


def test_the_report_rounds_the_reward_pools_seconds(tmp_path):
    results, trajs = _bench()
    bench = BenchmarkResult(benchmark_metrics("toy", results, trajs), results, trajs)
    stats = RewardStats(responses=4, verified=3, verify_s=3.058321530999592).as_dict()
    out = EvalReport({"toy": bench}, reward_stats=stats).write(tmp_path / "run")
    text = (out / "report.md").read_text()
    assert "4 responses scored (0 without a boxed answer); 3 answer comparisons" in text
    assert "0 decided as plain integers, 3 by math-verify in 3.06 s (" in text
    assert json.loads((out / "metrics.json").read_text())["reward_stats"]["verify_s"] == 3.058321530999592


def test_eval_config_drives_agent_config():
    agent = EvalConfig(samples=4, temperature=0.6, max_turns=30, max_tokens=1000).agent_config()
    assert (agent.temperature, agent.max_turns, agent.max_response_tokens) == (0.6, 30, 1000)


# ---- edges: the checks of pass@k's arguments, clustering that asks the verifier only when needed,
# majority ties, what counts as correct, and every aggregate of benchmark_metrics on unequal groups ----


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


def _traj_turns(n_tokens, generated, calls, finish="answered", turns=1):
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
        [
            _traj_turns(4, 3, ["ok"], turns=2),
            _traj_turns(6, 6, [], "length"),
            _traj_turns(2, 1, ["ok", "timeout"], turns=3),
        ],
        [_traj_turns(8, 2, [], "length", turns=1), _traj_turns(10, 8, ["runtime_error"], turns=2)],
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
    trajs = [
        [_traj_turns(1, 1, [], "length"), _traj_turns(1, 1, [], "answered"), _traj_turns(1, 1, [], "length")]
    ]
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
