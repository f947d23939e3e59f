"""Child processes die with the tirl command that started them, even when it is killed by SIGKILL, and
Ctrl-C reaches only that command, which then shuts its children down in order (a child that took the
terminal's SIGINT too would die first, printing a traceback, or leave the command waiting on it).

A command marks itself with `children_die_with_me()` (tirl.cli.main); then:
- forked children (vLLM's engine core on CPU) get the parent-death signal (prctl PR_SET_PDEATHSIG) and
  their own process group, through os.register_at_fork;
- Python children that import tirl (`tirl sandbox serve`, sandbox zygotes, reward workers, vLLM's
  engine core when spawned on CUDA) find their parent's pid in $TIRL_PARENT_PID when `import tirl`
  runs `adopt_parent_death()`: they take the parent-death signal and ignore SIGINT.
Linux sends the signal when the *thread* that started the child exits: tirl starts engines, sandboxes
and reward workers from threads that live as long as they do.
"""

from __future__ import annotations

import os
import signal

ENV = "TIRL_PARENT_PID"


def die_with_parent(parent: int | None = None) -> None:
    """SIGKILL this process when its parent dies; exit at once if the parent is already gone."""
    from tirl.linux import PR_SET_PDEATHSIG, prctl

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
    """In a process that a marked tirl command started: die with it, and leave Ctrl-C to it."""
    parent = os.environ.get(ENV)
    if parent and parent.isdigit() and int(parent) == os.getppid():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        die_with_parent(int(parent))
