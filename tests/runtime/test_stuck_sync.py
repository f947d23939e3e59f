"""A weight sync that cannot complete fails in minutes (here seconds), saying what to check, while
the other ranks can still wait out rank 0's rollouts as long as they take (issue 41, "Also")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.terminal import run_torchrun

from tirl.distributed.groups import collective_timeout_s

WORKER = Path(__file__).with_name("stuck_sync_worker.py")


@pytest.mark.timeout(900)  # a hang guard: two torchrun ranks take minutes on a loaded machine
def test_a_sync_a_rank_never_joins_fails_within_the_collective_timeout_naming_what_to_check(
    tiny_model_dir, tmp_path
):
    out = tmp_path / "result.json"
    proc = run_torchrun(WORKER, str(tiny_model_dir), str(out))
    assert out.is_file(), (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(out.read_text())
    assert result["waited"] == "samples"  # a wait on rank 0 longer than the collective timeout is fine
    error = result["error"]
    assert error is not None and error.startswith("TimeoutError: the weight sync's gathers did not complete")
    assert "Check every rank's log" in error and "TIRL_COLLECTIVE_TIMEOUT_S" in error
    assert 3.5 < result["seconds"] < 30, result  # the 4 s limit, not the hours a rollout may take


def test_the_collective_timeout_is_minutes_and_a_bad_value_is_one_line(monkeypatch):
    monkeypatch.delenv("TIRL_COLLECTIVE_TIMEOUT_S", raising=False)
    assert 60 <= collective_timeout_s() <= 1800
    monkeypatch.setenv("TIRL_COLLECTIVE_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="TIRL_COLLECTIVE_TIMEOUT_S='soon': give a number of seconds > 0"):
        collective_timeout_s()
