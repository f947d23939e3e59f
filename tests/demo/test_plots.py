"""Plots: real PNG files from metrics rows shaped like the trainer's metrics.jsonl."""

from __future__ import annotations

from tirl.demo.plots import TRAINING_CURVES, moving_average, plot_accuracy, plot_training

PNG = b"\x89PNG\r\n\x1a\n"


def rows(n: int, reward0: float) -> list[dict]:
    return [
        {
            "step": s,
            "reward/mean": reward0 + s / n / 2,
            "response/length_mean": 200 - s,
            "tools/error_ratio_in_correct": 0.2 / s,
            "tools/calls_per_traj": 1.0,
        }
        for s in range(1, n + 1)
    ]


def test_moving_average():
    assert moving_average([1, 2, 3, 4], 2) == [1.0, 1.5, 2.5, 3.5]
    assert moving_average([5.0], 3) == [5.0]
    assert moving_average([], 3) == []


def test_training_curves_and_accuracy_bars_are_pngs(tmp_path):
    paths = plot_training({"rl": rows(12, 0.3), "grpo": rows(12, 0.2)}, tmp_path)
    assert [p.name for p in paths] == [c[3] for c in TRAINING_CURVES]
    bars = plot_accuracy({"sft": 41.0, "rl": 77.5}, tmp_path)
    for p in [*paths, bars]:
        data = p.read_bytes()
        assert data.startswith(PNG) and len(data) > 5000


def test_missing_metrics_still_plot(tmp_path):
    (path, *_) = plot_training({"rl": [{"step": 1}], "grpo": []}, tmp_path)
    assert path.read_bytes().startswith(PNG)
