"""How the tests start a tirl command: from this checkout's source, in a subprocess, the way a user's
terminal starts it (for the Ctrl-C tests, as its foreground command)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.tied import tied, torchrun

SRC = str(Path(__file__).resolve().parents[1] / "src")


def foreground(argv: list[str]) -> list[str]:
    """`argv` (a program and its arguments) run as a terminal's foreground command (SIGINT at its
    default), dying with the test process, in this process's place: the pid Popen returns is the
    command's own (tests.tied)."""
    return tied(argv, foreground=True)


def tirl_env() -> dict[str, str]:
    """This process's environment with this checkout's source first on PYTHONPATH and without
    RAY_ADDRESS: a command starts its own private Ray, as on a laptop, unless it is told an address."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    return env


def tirl_argv(*args: str, launcher: Sequence[str] = ()) -> list[str]:
    """The command line of `tirl ARGS`; `launcher`: the arguments of a Python launcher that runs it
    (torchrun: tests.tied.torchrun("--nproc_per_node=2"))."""
    return [sys.executable, *launcher, "-m", "tirl.cli", *args]


def run_tirl(*args: str, timeout: float, launcher: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """`tirl ARGS` run to its end with tirl_env(); its output captured as text."""
    return subprocess.run(
        tirl_argv(*args, launcher=launcher), env=tirl_env(), capture_output=True, text=True, timeout=timeout
    )


def run_torchrun(
    script: str | Path, *args: str, nproc: int = 2, timeout: float = 800
) -> subprocess.CompletedProcess:
    """`script ARGS` in `nproc` local torchrun processes (one intra-op thread each: 2 cores) with
    tirl_env(); its output captured as text. `timeout` is a hang guard under pytest's 900 s: two ranks
    that take 10-30 s on idle cores take minutes on a loaded 2-core machine."""
    cmd = [sys.executable, *torchrun("--standalone", f"--nproc_per_node={nproc}")]
    env = tirl_env() | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*cmd, str(script), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
