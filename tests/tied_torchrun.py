"""torchrun (torch.distributed.run) that dies with the test process that started it, and whose ranks die
with it: torchrun starts each rank in a session of its own (out of reach of a kill of the test run's
process group) and without the parent-death signal, so a SIGKILLed torchrun leaves them running.

python tests/tied_torchrun.py PARENT_PID TORCHRUN_ARGS...  (tests.tied.torchrun builds this)
"""

from __future__ import annotations

import ctypes
import functools
import os
import runpy
import signal
import subprocess
import sys

_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before any fork: the rank's hook only calls it


def die_with(parent: int) -> None:
    """SIGKILL this process when `parent` (the process that started it) exits; exit now if it has."""
    if _prctl(1, signal.SIGKILL, 0, 0, 0):  # PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:
        os._exit(1)


def main() -> None:
    die_with(int(sys.argv[1]))
    sys.path.pop(0)  # this script's directory, tests/: none of its modules may shadow torch's imports
    # torchrun starts every rank binary through this module's Popen (SubprocessHandler._popen); each
    # rank takes the signal between its fork and its exec. torchrun starts them from its main thread.
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    rank_dies_with_torchrun = functools.partial(die_with, os.getpid())
    subprocess_handler.Popen = functools.partial(subprocess.Popen, preexec_fn=rank_dies_with_torchrun)
    sys.argv = ["torchrun", *sys.argv[2:]]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
