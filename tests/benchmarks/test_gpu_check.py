"""benchmarks/gpu_check.py at toy size on CPU (`--device cpu`): every part runs through tirl's real code
paths and reports its verdict and numbers, so the GPU check cannot rot between the rare lent GPUs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import gpu_check  # tests/benchmarks/conftest.py puts benchmarks/ on sys.path

SCRIPT = Path(gpu_check.__file__)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check")
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out), "--budget-s", "240"],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    lines = [json.loads(x) for x in (out / "gpu_check.jsonl").read_text().splitlines()]
    parts = {r["part"]: r for r in lines[1:]}
    return {"rc": proc.returncode, "header": lines[0]["gpu_check"], "parts": parts, "out": out, "proc": proc}


def test_every_part_runs_on_cpu_and_passes(report):
    assert list(report["parts"]) == list(gpu_check.PARTS)
    verdicts = {name: r["verdict"] for name, r in report["parts"].items()}
    assert verdicts == dict.fromkeys(gpu_check.PARTS, "PASS"), (verdicts, report["proc"].stdout[-3000:])
    assert report["rc"] == 0
    assert report["header"]["device"].startswith("cpu") and report["header"]["date"]


def test_memory_runs_the_update_plain_and_under_one_rank_fsdp_next_to_the_plan(report):
    n = report["parts"]["memory"]["numbers"]
    assert n["plain_trained_tokens"] > 0 and n["plain_padded_tokens"] >= n["plain_trained_tokens"]
    assert math.isfinite(n["plain_loss"]) and n["plain_grad_norm"] > 0
    # FSDP2 over one rank trains the same update: the same loss and gradient norm
    assert n["fsdp_loss"] == pytest.approx(n["plain_loss"], rel=1e-5)
    assert n["fsdp_grad_norm"] == pytest.approx(n["plain_grad_norm"], rel=1e-4)
    assert n["plan_peak_bytes"] > 0 and n["plan_training_total_gib"] > 0
    assert n["plain_peak_allocated_gib"] is None  # no allocator to read on CPU: said, not invented


def test_colocated_checkpoint_export_and_resume_are_exact(report):
    n = report["parts"]["colocated"]["numbers"]
    for kind in ("full", "lora"):
        assert n[f"{kind}_resume_exact"] is True and n[f"{kind}_resume_max_diff"] == 0.0
        assert n[f"{kind}_resume_rel_step"] == 0.0
        assert n[f"{kind}_export_matches"] <= 1e-6
        assert n[f"{kind}_offloaded"] is False  # nothing to offload on CPU
    assert any("no collectives" in x for x in report["parts"]["colocated"]["notes"])


def test_speed_reports_the_update_the_head_and_the_handoff(report):
    n = report["parts"]["speed"]["numbers"]
    assert n["update_tokens_per_s"] > 0 and n["mfu_vs_measured_peak"] > 0
    for tokens in gpu_check.Sizes.for_device("cpu").head_tokens:
        assert n[f"head_{tokens}_chunked_s"] > 0 and n[f"head_{tokens}_unchunked_s"] > 0
    assert n["handoff_bytes"] > 0 and n["handoff_gb_s"] > 0 and n["copy_gb_s"] > 0
    # the flat-buffer path the trainer runs (on CPU its buffer is the shared host file; on a GPU it
    # stays in device memory and handoff_host_bytes is 0)
    assert n["handoff_buffers"] == 1 and n["handoff_host_bytes"] == n["handoff_bytes"]


def test_e2e_trains_with_the_real_sandbox_and_an_engine_gap_near_zero(report):
    part = report["parts"]["e2e"]
    n = part["numbers"]
    assert n["float32_rc"] == 0 and n["float32_steps"] == 1
    assert "float32_sandbox" not in n  # the local sandbox ran: no fallback to in-process
    assert n["float32_gap_max"] is not None and n["float32_gap_max"] < 1e-4
    assert any("need CUDA" in x for x in part["notes"])


def test_the_markdown_table_has_a_row_per_part(report):
    table = (report["out"] / "gpu_check.md").read_text().splitlines()
    assert [row.split("|")[1].strip() for row in table[2:]] == list(gpu_check.PARTS)
    assert report["proc"].stdout.rstrip().endswith(table[-1])


def test_a_failing_part_is_fail_with_its_traceback_and_the_next_part_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # main() sets it for its children

    def broken(ctx):
        raise RuntimeError("planted")

    monkeypatch.setitem(gpu_check.RUNNERS, "memory", broken)
    ran = []
    monkeypatch.setitem(
        gpu_check.RUNNERS, "colocated", lambda ctx: ran.append(1) or gpu_check.Result("colocated", "PASS")
    )
    assert gpu_check.main(["--device", "cpu", "--only", "memory,colocated", "--out", str(tmp_path)]) == 1
    rows = [json.loads(x) for x in (tmp_path / "gpu_check.jsonl").read_text().splitlines()[1:]]
    assert [(r["part"], r["verdict"]) for r in rows] == [("memory", "FAIL"), ("colocated", "PASS")]
    assert rows[0]["numbers"]["error"] == "RuntimeError: planted"
    assert any("Traceback" in x for x in rows[0]["notes"]) and ran == [1]


def test_an_unknown_part_is_one_line(capsys):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--only", "memory,nope"])
    assert "unknown part(s) ['nope']" in capsys.readouterr().err


def test_the_cuda_only_tests_are_found_by_their_skip_mark():
    tests = gpu_check.cuda_only_tests()
    assert "tests/engines/test_hf.py::test_sleep_on_a_gpu_frees_the_weights_and_wakes_up_the_same" in tests
    assert all("::test" in t for t in tests)


# ---- the check's own risks (issue 68): a rare GPU run must not be wasted ----


def test_the_parts_run_by_value_the_end_to_end_one_first():
    """e2e, the only end-to-end evidence, ran last and was the part a short budget cut."""
    assert gpu_check.PARTS == ("e2e", "memory", "colocated", "speed")


def test_each_part_is_written_the_moment_it_ends(tmp_path):
    """A run killed after some parts (the device tool's time limit) still returns those parts."""
    header = {"device": "cpu", "date": "2026-12-07", "commit": "abc"}
    report = gpu_check.Report(str(tmp_path), header)

    def lines() -> list[dict]:
        return [json.loads(x) for x in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]

    assert lines() == [{"gpu_check": header}]
    report.add(gpu_check.Result("e2e", "PASS", {"steps": 3}, seconds=1.0))
    assert [r.get("part") for r in lines()] == [None, "e2e"]
    assert "| e2e | PASS |" in (tmp_path / "gpu_check.md").read_text()
    report.add(gpu_check.Result("memory", "SKIP", notes=["budget: 0 s left"]))
    assert [r.get("part") for r in lines()] == [None, "e2e", "memory"]


def test_a_part_the_budget_stops_is_skip_not_fail(tmp_path):
    """e2e with 5 s left: its `tirl train` is stopped by the budget, which says nothing about tirl."""
    import time

    import torch

    env = dict(os.environ) | {"PYTHONPATH": str(Path(gpu_check.ROOT) / "src")}
    ctx = gpu_check.Ctx(
        torch.device("cpu"), gpu_check.Sizes.for_device("cpu"), tmp_path, time.monotonic() + 5, env=env
    )
    result = gpu_check.run_part("e2e", ctx)
    assert result.verdict == "SKIP", result
    assert any("budget" in note for note in result.notes)


def test_the_commit_comes_from_the_caller_where_the_tree_has_no_git(tmp_path):
    assert gpu_check.commit("abc1234", root=tmp_path) == "abc1234"
    assert gpu_check.commit(None, root=tmp_path) == "unknown"
