"""Child processes die with the tirl command that started them, even when it is killed by SIGKILL, and
Ctrl-C reaches only that command (which then shuts its children down in order).

A command marks itself with `children_die_with_me()`; then:
- forked children (vLLM's engine core on CPU, spawned from the engine's thread) get the parent-death
  signal (prctl PR_SET_PDEATHSIG) and their own process group, through os.register_at_fork;
- exec'd tirl children (`tirl sandbox serve` started by a run, vLLM's engine core started with
  multiprocessing `spawn` on CUDA: both import tirl.cli first) find their parent's pid in
  $TIRL_PARENT_PID and call `die_with_parent()` themselves.
Linux sends the signal when the *thread* that started the child exits: tirl starts engines and the
sandbox service from threads that live as long as they do.
"""

from __future__ import annotations

import os
import signal

ENV = "TIRL_PARENT_PID"


def die_with_parent(parent: int | None = None) -> None:
    """SIGKILL this process when its parent dies; exit at once if the parent is already gone."""
    from tirl.sandbox.linux import PR_SET_PDEATHSIG, prctl

    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:  # the parent died before the prctl
        os._exit(1)


def _forked_child() -> None:
    os.setpgid(0, 0)  # out of the terminal's foreground group: Ctrl-C goes to the parent alone
    die_with_parent()


def children_die_with_me() -> None:
    """Make every child this process starts from now on die with it (see the module docstring)."""
    os.environ[ENV] = str(os.getpid())
    os.register_at_fork(after_in_child=_forked_child)


def adopt_parent_death() -> None:
    """In a tirl process that a marked tirl command started: die with that command."""
    parent = os.environ.get(ENV)
    if parent and parent.isdigit() and int(parent) == os.getppid():
        die_with_parent(int(parent))
