"""The non-root path: the service run by an unprivileged user (user namespaces instead of root).

The service process is started as root only to be given a view of the filesystem in which the
Python runtime is reachable by an unprivileged user (here it lives under /root, mode 0700; a
private mount namespace puts a world-traversable tmpfs there with the runtime bound back), then
it drops to uid/gid 65534 for good before anything of the sandbox runs. Everything the sandbox
does from then on is what any unprivileged user could do on this kernel.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import tirl
from tirl.sandbox import isolation

NOBODY = 65534

# Runs as root, then as NOBODY: prints one JSON line with what the checks saw.
SERVICE = r"""
import asyncio, json, os, sys
from tirl import linux

def expose(blocked):
    '''A tmpfs (0755) over each directory NOBODY cannot traverse, with the needed entries bound back.'''
    linux.unshare(linux.CLONE_NEWNS)
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    for top, names in blocked.items():
        fds = {n: os.open(os.path.join(top, n), os.O_PATH) for n in names}
        linux.mount("tmpfs", top, "tmpfs", 0, "mode=0755")
        for n, fd in fds.items():
            os.mkdir(os.path.join(top, n))
            linux.mount(f"/proc/self/fd/{fd}", os.path.join(top, n), None, linux.MS_BIND | linux.MS_REC)

expose(json.loads(sys.argv[1]))
os.setgroups([])
os.setresgid(NOBODY, NOBODY, NOBODY)
os.setresuid(NOBODY, NOBODY, NOBODY)
os.chdir("/")
from tirl.sandbox import Sandbox

LEFTOVER = '''
import ctypes, os, time
if os.fork() == 0:
    os.setsid()
    ctypes.CDLL(None).prctl(15, b"tirl-leftover", 0, 0, 0)  # PR_SET_NAME
    time.sleep(60)
print('forked')
'''
FORKS = '''
import os, time
n = 0
try:
    for _ in range(40):
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as e:
    print(n, e.errno)
'''

LISTEN = "import socket\ns = socket.socket(socket.AF_UNIX)\ns.bind('\\0tirl-meet')\ns.listen()\nprint('listening')"
CONNECT = (
    "import socket\nc = socket.socket(socket.AF_UNIX)\ntry:\n    c.connect('\\0tirl-meet')\n    print('met')\n"
    "except OSError as e:\n    print(type(e).__name__)"
)

def comms():
    names = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            names.append(open(f"/proc/{pid}/comm").read().strip())
        except OSError:
            pass
    return names

async def main():
    out = {}
    async with Sandbox(slots=1, preload=[], warmup=[], limits={"timeout_s": 10, "max_procs": 8}) as sb:
        out["features"] = sb.features()["active"]
        out["missing"] = sb.features()["missing"]
        if out["features"]["mode"] != "userns":
            print(json.dumps(out))
            return
        r = await sb.run("import os\nprint(os.getpid(), os.getuid(), sorted(os.listdir('/proc'))[-3:])")
        out["self"] = r.stdout
        r = await sb.run("print([l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0])")
        out["caps"] = r.stdout.strip()
        r = await sb.run(f"import os\nprint([p for p in {sys.argv[2:]!r} if os.path.lexists(p)])")
        out["visible"] = r.stdout.strip()
        r = await sb.run("open('/tmp/mine', 'w').write('x')\nprint('wrote')")
        r = await sb.run("import os\nprint(os.path.exists('/tmp/mine'))")
        out["tmp_carried_over"] = r.stdout.strip()
        r = await sb.run(LEFTOVER)
        out["leftover_call"] = r.stdout.strip()
        out["leftover_alive"] = "tirl-leftover" in comms()
        r = await sb.run(FORKS)
        out["forks"] = r.stdout.strip()
        r = await sb.run("import os\ntry:\n    os.kill(-1, 9)\nexcept ProcessLookupError:\n    print('nobody else')")
        out["kill_all"] = r.stdout.strip()
        r = await sb.run("print('still serving')")
        out["after"] = r.stdout.strip()
        async with await sb.open_session() as session:  # lives on: it must not meet the slot's calls
            r = await session.run(LISTEN)
            out["session_listens"] = r.stdout.strip()
            r = await sb.run(CONNECT)
            out["call_connects"] = r.stdout.strip()
    print(json.dumps(out))

asyncio.run(main())
""".replace("NOBODY", str(NOBODY))


def _traversable_by_others(path: Path) -> bool:
    return bool(path.stat().st_mode & stat.S_IXOTH)


def _blocked_dirs() -> dict[str, list[str]]:
    """Directories on the way to the runtime that NOBODY cannot enter -> the entries to bind back."""
    needed = {
        Path(p).resolve()
        for p in (sys.executable, sys.prefix, sys.base_prefix, Path(tirl.__file__).parents[1])
    }
    blocked: dict[str, set[str]] = {}
    for path in needed:
        for parent in [*reversed(path.parents), path][:-1]:
            if not _traversable_by_others(parent):
                child = path.relative_to(parent).parts[0]
                if not _traversable_by_others(parent / child):
                    pytest.skip(f"{parent / child} is not traversable by others: cannot expose the runtime")
                blocked.setdefault(str(parent), set()).add(child)
                break
    return {k: sorted(v) for k, v in blocked.items()}


@pytest.fixture(scope="module")
def unprivileged_run(canary):
    if os.geteuid() != 0:
        pytest.skip("needs root to prepare a view of the runtime for uid 65534 (then drops to it)")
    if not isolation.userns_available():
        pytest.skip("this kernel does not let unprivileged users create user namespaces")
    hidden = [str(canary), "/root/.bashrc", "/etc/shadow", "/home", "/sys/fs/cgroup", "/var/log"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(tirl.__file__).parents[1]), "LANG": "C.UTF-8"}
    proc = subprocess.run(
        [sys.executable, "-c", SERVICE, json.dumps(_blocked_dirs()), *hidden],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd="/",
    )
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    if seen["features"]["mode"] != "userns":
        pytest.skip(f"uid {NOBODY} cannot create user namespaces here: {seen['missing']}")
    return seen


def test_unprivileged_service_runs_with_user_namespaces(unprivileged_run):
    f = unprivileged_run["features"]
    assert f["mode"] == "userns" and f["pid_namespace"] and f["allowlisted_root"] and f["seccomp_denylist"], f
    pid, uid, _ = unprivileged_run["self"].split(" ", 2)
    assert (pid, uid) == ("1", str(NOBODY)), (
        "each call is pid 1 of its own pid namespace, as the service's uid"
    )
    assert unprivileged_run["caps"] == "0000000000000000", "no capabilities left from the user namespace"
    assert unprivileged_run["visible"] == "[]", "host files outside the allowlist do not exist"
    assert unprivileged_run["tmp_carried_over"] == "False", "each call has a fresh /tmp"


def test_unprivileged_calls_cannot_outlive_or_kill_anything(unprivileged_run):
    """No pid namespace per call used to mean: a setsid() child outlived its call (and could read the
    next calls' memory through /proc/<pid>/mem, same uid), fork bombs were unbounded, and
    kill(-1) killed the service itself."""
    assert unprivileged_run["leftover_call"] == "forked"
    assert unprivileged_run["leftover_alive"] is False, "the call's setsid() child died with it"
    count, errno = unprivileged_run["forks"].split()
    assert errno == "11" and int(count) < 8, unprivileged_run["forks"]  # EAGAIN at max_procs (RLIMIT_NPROC)
    assert unprivileged_run["kill_all"] == "nobody else", "kill(-1) reaches nothing outside the call"
    assert unprivileged_run["after"] == "still serving"


def test_unprivileged_sessions_cannot_meet_the_slots_calls(unprivileged_run):
    """A session used to share its slot's network namespace: abstract unix sockets (and the file
    descriptors they pass) connected it to every later call of that slot."""
    assert unprivileged_run["session_listens"] == "listening"
    assert unprivileged_run["call_connects"] == "ConnectionRefusedError"
