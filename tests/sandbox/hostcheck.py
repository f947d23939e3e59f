"""What 'the host is untouched' means, checked from outside the sandbox."""

from __future__ import annotations

import os
from pathlib import Path


def _status(pid: str) -> dict[str, str]:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def processes_of_uids(uids: set[int], include_zombies: bool = True) -> list[int]:
    """Processes running as any of `uids` (a sandbox uid outliving its call is a leak)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        st = _status(pid)
        if st and int(st["Uid"].split()[0]) in uids and (include_zombies or not st["State"].startswith("Z")):
            found.append(int(pid))
    return found


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def rss_pages(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1])


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def zygote_pids(parent: int) -> list[int]:
    """The zygotes serving a pool that lives in process `parent`."""
    out = []
    for c in children(parent):
        try:
            if b"tirl.sandbox.zygote" in Path(f"/proc/{c}/cmdline").read_bytes():
                out.append(c)
        except OSError:
            pass
    return out


def fork_server(zygote: int) -> int:
    """The fork server of a zygote (its only child): the parent of every call's process."""
    kids = children(zygote)
    assert len(kids) == 1, f"zygote {zygote} should have exactly its fork server as child, has {kids}"
    return kids[0]


def assert_host_untouched(canary: Path, uids: list[int], zygotes: list[int]) -> None:
    """Host files intact; per zygote its fork server with at most one prepared (idle) child; nothing else."""
    assert canary.read_text() == "untouched\n", "sandboxed code changed a host file"
    wait_idle(zygotes)  # the next prepared child is forked right after a call ends
    prepared = set()
    for z in zygotes:
        assert _status(str(z)).get("State", "").startswith(("S", "R")), f"zygote {z} is not healthy"
        server = fork_server(z)
        kids = children(server)
        assert len(kids) <= 1, f"fork server {server} has leftover children {kids} (zombies or strays)"
        for k in kids:
            assert _status(str(k)).get("State", "Z").startswith(("S", "R")), (
                f"fork server {server} has a zombie child"
            )
            assert children(k) == [], f"the prepared child {k} has children: a leftover of the last call"
        prepared |= set(kids)
    strays = set(processes_of_uids(set(uids))) - prepared
    assert not strays, f"processes of sandbox uids outlived their call: {strays}"


def wait_idle(zygotes: list[int], timeout: float = 120.0) -> None:
    """Wait until every fork server has forked its next prepared child (it does so as a call ends).

    The timeout is a hang guard: on a loaded machine the fork can lag by seconds, and returning early
    would make the caller's checks see a server between two children."""
    import time

    def idle(z: int) -> bool:
        kids = children(z)
        return (
            len(kids) == 1
            and len(children(kids[0])) == 1
            and all(_status(str(p)).get("State", "").startswith("S") for p in (z, kids[0]))
        )

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(idle(z) for z in zygotes):
            return
        time.sleep(0.02)
