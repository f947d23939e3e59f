"""How the tests start a tirl command: from this checkout's source, in a subprocess, the way a user's
terminal starts it (for the Ctrl-C tests, as its foreground command)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

# An ignored signal stays ignored across exec, and a shell that starts a job in the background without
# job control (`cmd &` in a script, nohup) ignores SIGINT for it: a test run started so would pass that
# on to every command it starts, and Ctrl-C could never reach them. A terminal's foreground command
# starts with SIGINT at its default; this exec wrapper restores that before the command runs.
_DEFAULT_SIGINT = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"


def foreground(argv: list[str]) -> list[str]:
    """`argv` (a program and its arguments) run with SIGINT at its default disposition, in this process's
    place: the pid Popen returns is the command's own."""
    return [sys.executable, "-c", _DEFAULT_SIGINT, *argv]


def tirl_env() -> dict[str, str]:
    """This process's environment with this checkout's source first on PYTHONPATH and without
    RAY_ADDRESS: a command starts its own private Ray, as on a laptop, unless it is told an address."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, env.get("PYTHONPATH")]))
    return env


def tirl_argv(*args: str, launcher: Sequence[str] = ()) -> list[str]:
    """The command line of `tirl ARGS`; `launcher`: the arguments of a Python launcher that runs it
    (torchrun: ["-m", "torch.distributed.run", "--nproc_per_node=2"])."""
    return [sys.executable, *launcher, "-m", "tirl.cli", *args]


def run_tirl(*args: str, timeout: float, launcher: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """`tirl ARGS` run to its end with tirl_env(); its output captured as text."""
    return subprocess.run(
        tirl_argv(*args, launcher=launcher), env=tirl_env(), capture_output=True, text=True, timeout=timeout
    )


def run_torchrun(
    script: str | Path, *args: str, nproc: int = 2, timeout: float = 240
) -> subprocess.CompletedProcess:
    """`script ARGS` in `nproc` local torchrun processes (one intra-op thread each: 2 cores) with
    tirl_env(); its output captured as text."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = tirl_env() | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*cmd, str(script), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
