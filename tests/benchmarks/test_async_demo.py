"""benchmarks/async_demo.py --seeds: the comparison over seeds (sync vs async, paired by seed) from
finished runs, and the resume rule (a run whose result file exists is not run again)."""

from __future__ import annotations

import json
from pathlib import Path

from async_demo import compare_seeds, run_or_load

CURVE_KEYS = ("reward/mean", "tools/error_ratio_in_correct", "response/length_mean", "tools/calls_per_traj")


def _finished_run(tmp: Path, name: str, reward: float, accuracy: float) -> dict:
    run_dir = tmp / name
    run_dir.mkdir()
    rows = [{"step": s, **dict.fromkeys(CURVE_KEYS, reward + s / 100)} for s in range(1, 7)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"run": name, "run_dir": str(run_dir), "heldout_accuracy": accuracy, "rl_wall_s": 100.0}


def test_compare_seeds_pairs_async_with_sync_by_seed(tmp_path):
    sync = [_finished_run(tmp_path, f"sync_seed{s}", 0.5, acc) for s, acc in enumerate([80.0, 82.0, 84.0])]
    asyn = [_finished_run(tmp_path, f"async_seed{s}", 0.4, acc) for s, acc in enumerate([79.0, 81.0, 83.0])]
    summary = compare_seeds({"sync": sync, "async": asyn}, tmp_path)

    acc = summary["heldout_accuracy"]
    assert acc["sync"]["mean"] == 82.0 and acc["async"]["mean"] == 81.0
    # async - sync is -1 for every seed: a paired difference with no spread
    assert acc["difference"] == {"mean": -1.0, "low": -1.0, "high": -1.0, "n": 3, "p": 0.0}
    reward = summary["final"]["reward/mean"]
    assert round(reward["difference"]["mean"], 6) == -0.1  # last 5 steps, paired
    assert json.loads((tmp_path / "seeds.json").read_text())["seeds"] == 3
    assert (tmp_path / "figure9.png").stat().st_size > 0


def test_a_finished_run_is_loaded_not_run_again(tmp_path):
    done = {"run": "sync_seed0", "heldout_accuracy": 80.0}
    (tmp_path / "sync_seed0.json").write_text(json.dumps(done))
    # settings and demo are never read: a run would fail on them
    assert run_or_load(None, tmp_path / "no-demo", tmp_path, "sync_seed0") == done


def test_curves_plot_named_finished_runs_and_refuse_a_directory_without_metrics(tmp_path):
    import matplotlib.image
    import pytest

    from async_demo import _named_runs, plot_runs

    runs = {
        n: Path(_finished_run(tmp_path, n.split(",")[0], 0.3, 0.0)["run_dir"]) for n in ("sync", "exact, k=1")
    }
    assert _named_runs([f"{n}={d}" for n, d in runs.items()]) == runs
    png = plot_runs(runs, tmp_path / "curves.png")
    assert matplotlib.image.imread(png).shape[:2] == (650, 1100)  # the 2 x 2 figure at 100 dpi
    with pytest.raises(SystemExit, match="NAME=RUN_DIR"):
        _named_runs([f"exact={tmp_path}"])  # no metrics.jsonl there
    with pytest.raises(SystemExit, match="NAME=RUN_DIR"):
        _named_runs([str(runs["sync"])])


def test_the_cpu_hog_runs_beside_the_block_and_is_gone_after_it():
    import os
    import time

    from async_demo import cpu_hog

    def cpu_seconds(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    children = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    before = set(children.read_text().split())  # other tests' servers, if any
    with cpu_hog(2):
        hogs = [int(p) for p in set(children.read_text().split()) - before]
        time.sleep(1.0)
        assert len(hogs) == 2 and all(cpu_seconds(p) > 0.1 for p in hogs), "the hogs are not busy"
    assert set(children.read_text().split()) <= before and not any(Path(f"/proc/{p}").exists() for p in hogs)


def test_the_cpu_hog_dies_with_a_benchmark_killed_9(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    script = f"import sys; sys.path.insert(0, {str(bench)!r})\nfrom async_demo import cpu_hog\nimport time\n"
    script += "with cpu_hog(1):\n    time.sleep(60)\n"
    parent = subprocess.Popen([sys.executable, "-c", script])
    children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children")
    deadline = time.monotonic() + 120  # the child imports torch and tirl first
    while not (children.exists() and children.read_text().split()) and time.monotonic() < deadline:
        time.sleep(0.1)
    (hog,) = [int(p) for p in children.read_text().split()]
    time.sleep(0.5)  # the hog has asked for its death signal
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{hog}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = Path(f"/proc/{hog}/stat").exists() and Path(f"/proc/{hog}/stat").read_text().split()[2] != "Z"
    assert not alive, "the hog outlived its benchmark"
