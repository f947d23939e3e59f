"""Statistics over seeds: Student-t intervals, per-step bands with missing values, paired differences."""

from __future__ import annotations

import math

import pytest

from tirl.demo.seed_stats import interval, paired_difference, per_step, summarize


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
