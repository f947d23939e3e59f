"""Every process a test starts dies with the test run, even a run killed by SIGKILL (a CI timeout kills
pytest's process group, and with it every child still in that group).

A child that leaves pytest's process group (a command started in a session of its own, as a terminal
starts it; torchrun's ranks, which torchrun starts so) is started through `tied()`: it takes the
parent-death signal (prctl PR_SET_PDEATHSIG) before its program runs, so it dies with the test process
whichever way that dies. Under torchrun, `torchrun()` is the launcher whose ranks die with torchrun the
same way (tests/tied_torchrun.py). tests/test_killed_test_run.py kills a test run and finds no survivor.

Linux sends the signal when the *thread* that started the child exits: tests start their processes from
the thread the test runs in, which outlives them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

TORCHRUN = Path(__file__).with_name("tied_torchrun.py")

# An exec wrapper (the pid Popen returns is the program's own): the parent-death signal, exit if the test
# process died before it was set, then the program. With "foreground", SIGINT back at its default: an
# ignored signal stays ignored across exec, and a shell that starts a job in the background without job
# control (`cmd &` in a script, nohup) ignores SIGINT for it, while a terminal's foreground command
# starts with SIGINT at its default (the Ctrl-C tests need that).
_EXEC = (
    "import ctypes, os, signal, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0):  # PR_SET_PDEATHSIG\n"
    "    raise OSError(ctypes.get_errno(), 'prctl(PR_SET_PDEATHSIG)')\n"
    "if os.getppid() != int(sys.argv[1]):  # the test process died before the prctl\n"
    "    os._exit(1)\n"
    "if sys.argv[2] == 'foreground':\n"
    "    signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
    "os.execv(sys.argv[3], sys.argv[3:])\n"
)


def tied(argv: list[str], foreground: bool = False) -> list[str]:
    """`argv` (a program, by path, and its arguments) run so that it dies with this process; with
    `foreground`, as a terminal's foreground command (SIGINT at its default)."""
    mode = "foreground" if foreground else "-"
    return [sys.executable, "-c", _EXEC, str(os.getpid()), mode, *argv]


def torchrun(*args: str) -> list[str]:
    """The arguments after `python` that run torchrun (torch.distributed.run) with `args`, torchrun dying
    with this process and its ranks with torchrun."""
    return [str(TORCHRUN), str(os.getpid()), *args]


def run_to_the_end_or_fault(cmd: list[str], env: dict, fault: str | None, timeout: float) -> None:
    """Run `cmd` in its own session (dying with the test all the same), wait for it, kill its whole group
    (the sandbox and reward workers it left behind), and assert it ended as asked: 0, or SIGKILLed by
    the fault hook when `fault` is set. `timeout` is a hang guard only: the kill point is the hook."""
    import contextlib
    import signal
    import subprocess

    proc = subprocess.Popen(tied(cmd), env=env, start_new_session=True, stderr=subprocess.PIPE)
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    want = -signal.SIGKILL if fault else 0
    assert proc.returncode == want, (fault, proc.returncode, err.decode()[-3000:])
