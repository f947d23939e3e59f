"""Statistics over seeds: Student-t intervals, per-step bands with missing values, paired differences."""

from __future__ import annotations

import math

import pytest

from tirl.demo.seed_stats import (
    against_zero,
    claims,
    interval,
    paired_difference,
    per_step,
    summarize,
    verdict,
    window_change,
)


def test_interval_is_the_student_t_interval_of_the_mean():
    iv = interval([1.0, 2.0, 3.0])  # mean 2, sd 1, t(0.975, df=2) = 4.3027
    half = 4.302653 / math.sqrt(3)
    assert (iv.mean, iv.n) == (2.0, 3)
    assert iv.low == pytest.approx(2 - half, abs=1e-5) and iv.high == pytest.approx(2 + half, abs=1e-5)
    assert interval([5.0]).low == interval([5.0]).high == 5.0  # one seed: no width
    assert interval([]) is None and interval([None]) is None


def test_per_step_skips_steps_where_the_metric_is_undefined():
    seeds = [
        [{"step": 1, "x": 0.2}, {"step": 2, "x": None}],  # None: no correct trajectory called the tool
        [{"step": 1, "x": 0.4}, {"step": 2, "x": 0.1}],
    ]
    bands = per_step(seeds, "x")
    assert bands[1].mean == pytest.approx(0.3) and bands[1].n == 2
    assert bands[2].mean == pytest.approx(0.1) and bands[2].n == 1


def test_paired_difference_pairs_by_seed():
    # Seed effects dominate each run's spread; the paired difference is exactly 1 every time.
    a, b = [10.0, 20.0, 30.0], [9.0, 19.0, 29.0]
    diff = paired_difference(a, b)
    assert diff.mean == pytest.approx(1.0) and diff.high - diff.low == pytest.approx(0.0)
    assert interval(a).low < interval(b).mean  # unpaired, the runs' intervals overlap
    assert paired_difference([1.0, None], [0.5, 0.2]).n == 1


def test_summarize_reports_last_steps_accuracy_and_differences():
    def run(values):
        return [{"step": i + 1, "reward/mean": v} for i, v in enumerate(values)]

    training = {
        "rl": [run([0.1, 0.5, 0.7]), run([0.2, 0.6, 0.8])],
        "grpo": [run([0.1, 0.3, 0.3]), run([0.2, 0.4, 0.4])],
    }
    out = summarize(training, {"sft": [50.0], "rl": [80.0, 84.0], "grpo": [70.0, 72.0]}, last=2)
    assert out["seeds"] == 2
    assert out["final"]["reward/mean"]["rl"]["mean"] == pytest.approx(0.65)  # mean of 0.6 and 0.7
    assert out["final"]["reward/mean"]["difference"]["mean"] == pytest.approx(0.3)
    assert out["heldout_accuracy"]["difference"]["mean"] == pytest.approx(11.0)
    assert out["heldout_accuracy"]["sft"]["mean"] == 50.0
    assert set(out["curves"]["reward/mean"]["rl"]) == {1, 2, 3}
    assert out["final"]["tools/calls_per_traj"]["rl"] is None  # never logged: no number invented


def test_a_difference_carries_the_t_tests_p_value_which_agrees_with_its_interval():
    from scipy.stats import ttest_1samp

    diffs = [1.0, 2.0, 0.5, 1.5, -0.2]
    iv = against_zero(diffs)
    assert iv.p == pytest.approx(ttest_1samp(diffs, 0.0).pvalue)
    assert (iv.p < 0.05) == (iv.low > 0 or iv.high < 0)  # p < 0.05 exactly when the interval excludes 0
    assert against_zero([3.0, 3.0]).p == 0.0 and against_zero([0.0, 0.0]).p == 1.0  # no spread: no nan
    assert against_zero([2.0]).p is None and interval(diffs).p is None  # one seed, or a plain mean
    assert "p" in paired_difference([2.0, 3.0], [1.0, 1.5]).to_dict()
    assert "p" not in interval(diffs).to_dict()


def test_window_change_is_the_runs_own_trend():
    rows = [{"step": s, "x": v} for s, v in enumerate([4.0, 2.0, None, 9.0, 1.0, 1.0], start=1)]
    assert window_change(rows, "x", 2) == pytest.approx(1.0 - 3.0)  # last two (1, 1) minus first two (4, 2)
    assert window_change(rows, "x", 3) is None  # 5 values: windows would overlap


@pytest.mark.parametrize(
    ("mean", "p", "expects", "says"),
    [
        (-1.0, 0.01, "lower", "yes"),
        (1.0, 0.01, "lower", "no: the opposite"),
        (-1.0, 0.30, "lower", "not shown"),
        (0.1, 0.60, "no change", "consistent"),
        (-1.0, 0.01, "no change", "no: lower"),
        (-1.0, 0.20, "not lower", "consistent"),
        (-1.0, 0.01, "not lower", "no: lower"),
        (2.0, 0.01, "not lower", "yes, higher"),
    ],
)
def test_verdict_reads_the_test_the_way_the_claim_is_worded(mean, p, expects, says):
    assert verdict({"mean": mean, "low": 0, "high": 0, "n": 5, "p": p}, expects).startswith(says)
    assert verdict({"mean": mean, "low": 0, "high": 0, "n": 1}, expects).startswith("not testable")


def test_claims_test_the_papers_figure_4_and_9_statements():
    def run(errors, lengths):
        return [
            {"step": i + 1, "tools/error_ratio_in_correct": e, "response/length_mean": n}
            for i, (e, n) in enumerate(zip(errors, lengths, strict=True))
        ]

    falls, flat = [0.10, 0.10, 0.02, 0.01], [0.10, 0.11, 0.10, 0.11]
    training = {
        "rl": [run(falls, [90, 80, 60, 50]), run([0.12, 0.10, 0.03, 0.02], [95, 85, 60, 55])],
        "grpo": [run(flat, [90, 90, 88, 90]), run([0.11, 0.12, 0.12, 0.10], [95, 90, 92, 96])],
    }
    comparison = summarize(training, {"rl": [70.0, 71.0], "grpo": [69.0, 72.0]}, last=2)
    rows = {r["claim"]: r for r in claims(comparison)}
    falls_row = rows["tool-error ratio in correct trajectories falls under RoC"]
    assert falls_row["tested"] == "change: rl"
    # display units: percent; (0.015 - 0.10) and (0.025 - 0.11) on the two seeds
    assert falls_row["interval"]["mean"] == pytest.approx(-8.5)
    assert falls_row["verdict"].startswith("yes")
    assert rows["tool-error ratio in correct trajectories plateaus under GRPO"]["verdict"].startswith(
        "consistent"
    )
    assert rows["RoC ends with shorter responses"]["interval"]["mean"] == pytest.approx(-35.25)
    assert rows["RoC's held-out accuracy is not worse"]["verdict"].startswith("consistent")  # 0 difference
