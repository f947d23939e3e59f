"""Child processes die with the tirl command that started them, even when it is killed by SIGKILL, and
Ctrl-C reaches only that command, which then shuts its children down in order (a child that took the
terminal's SIGINT too would die first, printing a traceback, or leave the command waiting on it).

A command marks itself with `children_die_with_me()` (tirl.cli.main); then:
- forked children (os.fork, multiprocessing's fork) get the parent-death signal (prctl
  PR_SET_PDEATHSIG) and their own process group, through os.register_at_fork;
- Python children that import tirl (`tirl sandbox serve`, sandbox zygotes, reward workers, vLLM's
  engine core, which vLLM starts with multiprocessing's spawn on CPU and on CUDA: fork+exec, so no
  at-fork hook runs in it) find their parent's pid in $TIRL_PARENT_PID when `import tirl` runs
  `adopt_parent_death()`: they take the parent-death signal, ignore SIGINT and leave the terminal's
  foreground process group. Leaving the group is what counts for vLLM's engine core: it installs its
  own SIGINT handler after `import tirl`, and a Ctrl-C that reached it would kill it (EngineDeadError
  in the command, which then waits on a dead engine); in its own group the terminal's SIGINT never
  reaches it or the workers it starts.
Linux sends the signal when the *thread* that started the child exits: tirl starts engines, sandboxes
and reward workers from threads that live as long as they do.

`stop_child()` is how a command ends a child it started: SIGTERM, then SIGKILL after a grace period.

`quiet_third_party()` keeps a command's output its own (library warnings off unless --verbose); the
children learn it from $TIRL_QUIET when they import tirl.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

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
    if os.environ.get(QUIET_ENV) == "1":  # the command's --verbose (or its absence) holds here too
        _ignore_foreign_warnings()
    parent = os.environ.get(ENV)
    if parent and parent.isdigit() and int(parent) == os.getppid():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _own_process_group()
        die_with_parent(int(parent))


# Third-party output a tirl command hides unless run with --verbose: library loggers and progress bars,
# set through the environment so that the processes the command starts (vLLM's engine core and its
# workers, Ray's) inherit them; tirl's own warnings and errors are kept.
QUIET_ENV = "TIRL_QUIET"
_QUIET = {
    "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM's (and its Triton probe's) warnings
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # c10 warnings such as "NUMA binding: Using MEMBIND policy"
    "TRANSFORMERS_VERBOSITY": "error",
    "TQDM_DISABLE": "1",  # "Loading safetensors checkpoint shards" bars in vLLM's workers
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


def stop_child(proc: subprocess.Popen, grace_s: float, group: bool = False) -> None:
    """SIGTERM to `proc` (with `group`, to its whole process group: a server's own workers), SIGKILL
    after `grace_s` if it has not exited; reaped on return."""
    if proc.poll() is not None:
        return

    def send(sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):  # it exited between the check and the signal
            os.killpg(proc.pid, sig) if group else proc.send_signal(sig)

    send(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait()


def quiet_third_party(verbose: bool = False) -> None:
    """Keep a command's output tirl's own: third-party warnings off, here and in its children, unless
    `verbose`. Call before the libraries are imported (they read these variables once)."""
    if verbose:
        os.environ[QUIET_ENV] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        return
    os.environ[QUIET_ENV] = "1"
    os.environ.update(_QUIET)
    _ignore_foreign_warnings()


def _ignore_foreign_warnings() -> None:
    """Python warnings raised outside tirl (deprecations inside vLLM, torch, transformers) are not shown."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", module=r"^(?!tirl(\.|$))")
    # vLLM logs its Triton probe while being imported, before it applies VLLM_LOGGING_LEVEL.
    logging.getLogger("vllm").setLevel(logging.ERROR)


def _own_process_group() -> None:
    """Leave the terminal's foreground group: Ctrl-C goes to the group, the tirl command alone handles it."""
    # A session leader (started with start_new_session) is out of the group already: EPERM.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
