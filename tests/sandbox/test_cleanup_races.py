"""Session clean-up under a race, checked by what is left inside the cgroup hierarchies the host reads:
a service killed with a session frozen between cells, then two new services cleaning up after it at
the same moment (two processes that both list its groups, meet at a barrier, then both end and remove
them)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tirl.sandbox import cgroups

KILLED_SERVICE = textwrap.dedent(
    """
    import asyncio
    from tirl.sandbox import Sandbox

    async def main():
        sb = Sandbox(slots=1, preload=[], warmup=[])
        await sb.start()
        s = await sb.open_session()
        await s.run("x = 1")  # frozen between cells from here on
        print(s.child.pid, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


def _groups_of(service_pid: int) -> list[Path]:
    """The service's groups and their slot leaves, in every hierarchy we are in (v1 or v2)."""
    found = []
    for controller, path in cgroups._own_paths().items():
        parent = (
            cgroups.ROOT / controller / path.lstrip("/") if controller else cgroups.ROOT / path.lstrip("/")
        )
        for group in parent.glob(f"{cgroups.PREFIX}*-{service_pid}") if parent.is_dir() else []:
            found += [*group.glob("slot*"), group]
    return found


def _clean_at_once(barrier, removed) -> None:
    """One new service's start-up clean-up; both have listed the stale groups before either acts."""
    real_end, met = cgroups._end_processes, []

    def end_after_both_listed(group: Path) -> None:
        if not met:
            met.append(barrier.wait(timeout=60))
        real_end(group)

    cgroups._end_processes = end_after_both_listed  # this forked process's own module
    removed.put(cgroups.clean_stale())


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(os.geteuid() != 0, reason="sessions are frozen (cgroup freezer) only as root")
def test_two_services_cleaning_up_a_killed_one_at_once_leave_nothing_of_it(tmp_path):
    service = subprocess.Popen([sys.executable, "-c", KILLED_SERVICE], stdout=subprocess.PIPE, text=True)
    try:
        session_pid = int(service.stdout.readline())
    finally:
        service.send_signal(signal.SIGKILL)  # no clean-up of its own: as after an OOM kill
        service.wait()
    left = _groups_of(service.pid)
    if not left:
        pytest.skip("no writable cgroup hierarchy here: a service leaves no group behind")
    assert not _gone(session_pid)  # frozen, outliving its service: what the clean-up is for
    ctx = multiprocessing.get_context("fork")
    barrier, removed = ctx.Barrier(2), ctx.Queue()
    cleaners = [ctx.Process(target=_clean_at_once, args=(barrier, removed)) for _ in "ab"]
    for c in cleaners:
        c.start()
    counts = [removed.get(timeout=60) for _ in cleaners]
    for c in cleaners:
        c.join(timeout=30)
        assert c.exitcode == 0
    assert [p for p in left if p.exists()] == [], "a group of the killed service is still there"
    assert sum(counts) >= len(left)  # each of its groups removed (once; other dead services' count too)
    assert _gone(session_pid), "the frozen session outlived both clean-ups"
