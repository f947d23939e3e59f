"""A test run killed the way a CI timeout kills it (SIGKILL to pytest's process group) leaves no process of
its tests behind. The case: the sharded-checkpoint test's two torchrun ranks, which torchrun starts in
sessions of their own, out of reach of the group kill; they die with torchrun, and torchrun with the
test, by the parent-death signal (tests/tied.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from tests.terminal import tirl_env
from tests.tied import tied

ROOT = Path(__file__).resolve().parents[1]
TARGET = "tests/rl/test_checkpoint_sharded.py::test_resume_from_shards_is_exact"
MARK = "TIRL_TEST_RUN_MARK"  # in the environment of every process the run starts, inherited by exec
HANG_S = 600  # a hang guard: the ranks start within a minute on a loaded 2-core machine


def marked(mark: str, rank: bool = False) -> dict[int, str]:
    """pid -> command line of each live process (zombies are dead) whose environment holds `mark`; with
    `rank`, only torchrun's ranks (LOCAL_RANK set)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            names = (proc / "environ").read_bytes().split(b"\0")
            if f"{MARK}={mark}".encode() not in names or (
                rank and not any(n.startswith(b"LOCAL_RANK=") for n in names)
            ):
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # exited meanwhile, or another user's
            continue
    return found


def ranks(mark: str) -> list[int]:
    return list(marked(mark, rank=True))


@pytest.mark.timeout(HANG_S + 120)
def test_a_test_run_killed_as_a_group_leaves_none_of_its_processes(tmp_path):
    mark = uuid.uuid4().hex
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", TARGET]
    argv += ["--basetemp", str(tmp_path / "run")]
    run = subprocess.Popen(
        tied(argv),
        cwd=ROOT,
        env=tirl_env() | {MARK: mark},
        start_new_session=True,  # a group of its own, as CI's job: the kill below is the CI timeout's
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + HANG_S  # polls another process's state: no event to wait on
        while len(ranks(mark)) < 2 and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert run.poll() is None and len(ranks(mark)) == 2, "the test run never had its two ranks"
        assert run.pid not in {os.getsid(pid) for pid in ranks(mark)}  # the group kill alone misses them
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
        deadline = time.monotonic() + 60  # SIGKILL is immediate: this only waits for the reaping
        while (survivors := marked(mark)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not survivors, survivors
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        for pid in marked(mark):  # a failed check leaves nothing running either
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
