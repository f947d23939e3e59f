"""The slot's CPU quota is enforced by the kernel on every process of a call.

Runs the v1 `cpu` controller where it is (this machine: cgroup v1+v2 hybrid, whose v2 hierarchy
offers only `hugetlb`) and v2's `cpu.max` on a pure cgroup v2 machine with the controller
delegated. The quota is lowered to a tenth of a CPU for the test, so even a loaded machine gives
the call's busy processes more than that and the quota must bind.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tirl.sandbox import Sandbox, Status

session_loop = pytest.mark.asyncio(loop_scope="session")

BUSY = """
import os, time
def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
for _ in range(3):
    if os.fork() == 0:
        os.setsid()  # a new session must not leave the slot's group
        spin(1.5)
        os._exit(0)
spin(1.5)
for _ in range(3):
    os.wait()
print('done')
"""
TENTH_US = 10_000  # per 100 ms period


def _throttled(cpu_dir: str) -> int:
    for line in Path(cpu_dir, "cpu.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "nr_throttled":
            return int(value)
    raise AssertionError(f"no nr_throttled in {cpu_dir}/cpu.stat")


@session_loop
async def test_the_cpu_quota_binds_every_process_of_a_call():
    async with Sandbox(slots=1, preload=[], warmup=[], limits={"timeout_s": 20}) as sb:
        group = sb._cgroups[0] if sb._cgroups else None
        if group is None or not group.cpu_dir or not group.cpuacct_dir:
            pytest.skip(f"no writable cpu cgroup controller here: {sb.features()['missing']}")
        if group.v2:
            Path(group.cpu_dir, "cpu.max").write_text(f"{TENTH_US} 100000")
        else:
            Path(group.cpu_dir, "cpu.cfs_quota_us").write_text(str(TENTH_US))
        before = _throttled(group.cpu_dir)
        r = await sb.run(BUSY)
        assert (r.status, r.stdout) == (Status.OK, "done\n"), r
        # Four busy processes for 1.5 s of wall time got at most a tenth of a CPU (plus three periods'
        # quota of slack): everything the call forked, setsid() or not, is in the group.
        assert r.extra["slot_cpu_ms"] <= 0.1 * r.wall_ms + 3 * TENTH_US / 1000, r.extra
        assert _throttled(group.cpu_dir) > before, "the kernel throttled the slot's group"
