"""Evaluation metrics and reports on hand-built trajectories (pure functions, real math-verify)."""

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
from tirl.eval.metrics import pass_k_values
from tirl.reward import equivalent


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


def test_eval_config_drives_agent_config():
    agent = EvalConfig(samples=4, temperature=0.6, max_turns=30, max_tokens=1000).agent_config()
    assert (agent.temperature, agent.max_turns, agent.max_response_tokens) == (0.6, 30, 1000)
