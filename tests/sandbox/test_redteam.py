"""The holes of the second red-team round (issue 11), each with its neighbours: closed and staying closed."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path

import httpx
import pytest

import tirl
from tirl.sandbox import ExecResult, Status
from tirl.sandbox.capture import Collected, StreamCapture
from tirl.sandbox.forkserver import STARTED
from tirl.sandbox.result import INFRA_STATUSES
from tirl.sandbox.zygote import Watch, _classify

from .hostcheck import assert_host_untouched, zygote_pids

session_loop = pytest.mark.asyncio(loop_scope="session")

# Looks for `A + B` in the process's own objects, frames and memory, where A and B are given as hex
# and never joined in this process (so the needle itself cannot be what is found).
SCAN = """
import ctypes, gc, sys
a, b = bytes.fromhex({a!r}), bytes.fromhex({b!r})
def has(buf):
    i = buf.find(a)
    while i >= 0:
        if buf[i + len(a): i + len(a) + len(b)] == b:
            return True
        i = buf.find(a, i + 1)
    return False
hits = set()
f = sys._getframe()
while f is not None:
    if any(isinstance(v, (str, bytes)) and has(v.encode('utf-8', 'replace') if isinstance(v, str) else v)
           for v in f.f_locals.values()):
        hits.add('frame')
    f = f.f_back
for o in gc.get_objects():
    vals = o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else ()
    if any(isinstance(v, str) and has(v.encode('utf-8', 'replace')) for v in vals):
        hits.add('object')
for line in open('/proc/self/maps').read().splitlines():
    span, perms = line.split()[:2]
    if not perms.startswith('rw') or line.endswith(('[vvar]', '[vsyscall]', '[vdso]')):
        continue
    lo, hi = (int(x, 16) for x in span.split('-'))
    for at in range(lo, hi, 1 << 24):
        if has(ctypes.string_at(at, min(hi, at + (1 << 24) + 64) - at)):
            hits.add('memory')
print(sorted(hits))
"""


@session_loop
@pytest.mark.parametrize("heavy", [False, True])
async def test_no_call_can_read_an_earlier_call(pool, heavy):
    """Code, stdin and output of a call are nowhere in the memory the next calls start from."""
    secret = f"tirl-secret-{uuid.uuid4().hex}"
    half = len(secret) // 2
    prefix = "import numpy\n" if heavy else ""
    victim = f"{prefix}data = {secret!r}\nprint(input(), data)"
    for _ in range(2):  # consecutive calls alternate between the two slots: leave it in both
        r = await pool.run(victim, stdin=secret + "\n")
        assert r.stdout == f"{secret} {secret}\n", r
    scan = prefix + SCAN.format(a=secret[:half].encode().hex(), b=secret[half:].encode().hex())
    for _ in range(2):
        r = await pool.run(scan, timeout=30)
        assert (r.status, r.stdout) == (Status.OK, "[]\n"), r
    # the scan does find what its own call holds (so "[]" above means absent, not blind)
    r = await pool.run(f"{prefix}kept = {secret!r}\n{scan}", timeout=30)
    assert "memory" in r.stdout and "object" in r.stdout, r


@session_loop
async def test_only_allowlisted_host_files_exist(pool, canary):
    """The host's data, the project's runs, home directories and /sys do not exist inside."""
    here = Path(__file__).resolve()
    probes = [
        str(here),
        str(here.parents[2] / "runs"),
        "/work/shared",
        "/home",
        "/root/.bashrc",
        "/var/log",
        "/etc/shadow",
        "/etc/hosts",
        "/sys/fs/cgroup",
        "/dev/ptmx",
        "/dev/pts",
        str(canary),
        "/old_root",
    ]
    code = f"import os\nprint([p for p in {probes!r} if os.path.lexists(p)])\nimport numpy, sympy\nprint('imports ok')"
    r = await pool.run(code, timeout=20)
    assert (r.status, r.stdout) == (Status.OK, "[]\nimports ok\n"), r
    r = await pool.run(
        "import json, os\nfor d in ('/', '/etc', '/dev'):\n    print(json.dumps(os.listdir(d)))"
    )
    top, etc, dev = (json.loads(line) for line in r.stdout.splitlines())
    # the Python runtime may live anywhere (a CI checkout under /check, a venv under /opt): its top dirs only
    runtime = (sys.prefix, sys.base_prefix, Path(tirl.__file__).resolve().parents[1])
    assert set(top) <= {
        "bin",
        "dev",
        "etc",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "proc",
        "sbin",
        "tmp",
        "usr",
        "var",
        *(Path(p).resolve().parts[1] for p in runtime),
    }, top
    assert set(etc) <= {"ld.so.cache", "localtime", "nsswitch.conf", "passwd", "group", "hostname"}, etc
    assert set(dev) <= {
        "null",
        "zero",
        "full",
        "random",
        "urandom",
        "shm",
        "fd",
        "stdin",
        "stdout",
        "stderr",
    }, dev
    assert_host_untouched(canary, pool.uids, zygote_pids(os.getpid()))


@session_loop
async def test_cross_call_channels_are_closed(pool):
    """Abstract unix sockets between slots, AF_VSOCK / netlink sockets, ptys: none reach another call."""
    name = f"tirl-{uuid.uuid4().hex[:12]}"
    listener = (
        "import socket, time\ns = socket.socket(socket.AF_UNIX)\n"
        f"s.bind('\\0{name}')\ns.listen()\ns.settimeout(4)\n"
        "try:\n    s.accept()\n    print('accepted')\nexcept OSError:\n    print('nobody')"
    )
    connector = (
        "import socket, time\ntime.sleep(1)\nc = socket.socket(socket.AF_UNIX)\n"
        f"try:\n    c.connect('\\0{name}')\n    print('connected')\nexcept OSError as e:\n    print(type(e).__name__)"
    )
    got = await pool.run_batch([{"code": listener, "timeout": 10}, {"code": connector, "timeout": 10}])
    assert [r.stdout for r in got] == ["nobody\n", "ConnectionRefusedError\n"], got
    families = (
        "import socket\nfor fam in (40, 16, 17, 31, 38):\n"
        "    try:\n        socket.socket(fam, socket.SOCK_STREAM if fam == 40 else socket.SOCK_RAW)\n        print(fam, 'open')\n"
        "    except OSError as e:\n        print(fam, e.errno)\n"
        "import os\ntry:\n    os.open('/dev/ptmx', os.O_RDWR)\nexcept OSError as e:\n    print('ptmx', type(e).__name__)"
    )
    r = await pool.run(families)
    assert r.stdout == "40 97\n16 97\n17 97\n31 97\n38 97\nptmx FileNotFoundError\n", r


FAKES = {
    "exit_with_setup_code": "import os\nos._exit(121)",
    "fake_setup_report": "import os\nos.write(3, b'{\"outcome\": \"confine_failed\", \"error\": \"x\"}\\n')\nos._exit(121)",
    "fake_start_then_report": (
        "import os\nos.write(3, b'\\x00started\\n{\"outcome\": \"confine_failed\"}\\n')\nos._exit(121)"
    ),
    "result_fd_garbage": "import os\nos.write(3, b'[1]\\n' + b'[' * 100000 + b'\\n\\xff\\n')\nraise SystemExit(2)",
    "closed_result_fd": "import os\nos.close(3)\nos._exit(121)",
}  # fmt: skip


@session_loop
@pytest.mark.parametrize("name", list(FAKES))
async def test_user_code_cannot_pose_as_an_infrastructure_failure(pool, name):
    r = await pool.run(FAKES[name])
    assert r.status not in INFRA_STATUSES, r
    assert r.status in (Status.RUNTIME_ERROR, Status.KILLED_BY_SIGNAL), r


@session_loop
async def test_a_call_cannot_pin_itself_to_a_busy_cpu(pool):
    """Pinned to a CPU that other processes keep busy, a spinning call got under 10% of a CPU while
    waiting to run: its own time-out read as `starved` (retried, dropped from the loss)."""
    r = await pool.run("import os\nprint(len(os.sched_getaffinity(0)) > 0)\nos.sched_setaffinity(0, {0})")
    assert (r.status, r.stdout) == (Status.RUNTIME_ERROR, "True\n") and "PermissionError" in r.message, r


def _collected(result: bytes, killed: str | None = None) -> Collected:
    return Collected(StreamCapture(64), StreamCapture(64), result, killed)


LIMITS = type("L", (), {"timeout_s": 2.0, "memory_mb": 256, "keep_bytes": 64, "output_bytes": 1 << 20})()


@pytest.mark.parametrize(
    ("watch", "expected"),
    [
        (Watch(9, 2000, False, 40.0, 1800.0), Status.STARVED),  # little CPU, long waits to run
        (Watch(9, 2000, False, 1900.0, 1500.0), Status.TIMEOUT),  # its own processes competing: its CPU
        (Watch(9, 2000, False, 2.0, 1.0), Status.TIMEOUT),  # sleeping: not waiting for a CPU
        (Watch(9, 2000, False, None, 1800.0), Status.TIMEOUT),  # no CPU accounting: never blamed on others
    ],
)
def test_starvation_is_told_from_a_slow_program(watch, expected):
    r = _classify(_collected(STARTED, killed="timeout"), watch, LIMITS)
    assert r.status == expected, r
    assert (expected in INFRA_STATUSES) == r.is_infra_error


def test_a_report_written_by_user_code_cannot_bloat_the_result():
    """The result pipe keeps 64 KiB at each end: a report line user code wrote there was a message of that size."""
    raw = (
        STARTED + b'{"outcome": "error", "error": "' + b"x" * 60000 + b'", "type": "' + b"y" * 3000 + b'"}\n'
    )
    r = _classify(_collected(raw), Watch(1 << 8, 5, False, None, None), LIMITS)
    assert (
        r.status == Status.RUNTIME_ERROR and len(r.message) == 1000 and len(r.extra["error_type"]) == 1000
    ), r


def test_classification_never_raises_and_trusts_nothing_after_start():
    for raw in (b"", STARTED + b"\xff\n[[[[\n" + b"{" * 50000, STARTED + b'{"outcome": "confine_failed"}\n'):
        for status in (0, 121 << 8, 9, 64, 0x7F):
            r = _classify(_collected(raw), Watch(status, 5, False, None, None), LIMITS)
            assert isinstance(r, ExecResult)
            assert r.is_infra_error == (not raw.startswith(STARTED)), (raw[:20], status, r)


@session_loop
async def test_a_lone_surrogate_never_breaks_a_result(pool, service):
    code = "raise ValueError(chr(0xd800))"
    r = await pool.run(code)
    assert r.status == Status.RUNTIME_ERROR and "\\ud800" in r.message, r
    r.message.encode("utf-8")
    results = await service.run_batch(
        [
            {"code": code},
            {"code": "print(1)"},
            {"code": "import sys\nsys.stdout.write(chr(0xdfff))\nprint(2)"},
        ]
    )
    assert [x.status for x in results] == [Status.RUNTIME_ERROR, Status.OK, Status.OK], results
    assert results[1].stdout == "1\n" and results[2].stdout.endswith("2\n")
    async with _http(service) as http:
        for path, body in (("/run", {"code": code}), ("/run_code", {"code": code, "language": "python"})):
            resp = await http.post(path, json=body)
            assert resp.status_code == 200, resp.text


@session_loop
async def test_a_lone_surrogate_in_stdin_is_the_programs_text_not_a_sandbox_error(pool, service):
    """A model's tool call can carry "\\ud800" in its code or input: the client used to fail to send
    it, the supervisor to raise on it (sandbox_error: retried, dropped from the loss; zygote recycled)."""
    code = "print(repr(input()))"
    r = await pool.run(code, stdin="a\ud800b\udc80c")
    assert (r.status, r.stdout) == (Status.OK, "'a\\\\ud800b\\\\x80c'\n"), r
    # through SandboxClient and HTTP: httpx used to refuse to encode the body (sandbox_error, retried)
    got = await service.run_batch(
        [{"code": code, "stdin": "\udfff"}, {"code": "s = '\ud800'\nprint(len(s))"}, {"code": "print(1)"}]
    )
    assert [(x.status, x.stdout) for x in got] == [
        (Status.OK, "'\\\\udfff'\n"),
        (Status.RUNTIME_ERROR, ""),  # source Python cannot compile: the program's error, not the sandbox's
        (Status.OK, "1\n"),
    ], got
    assert "surrogates not allowed" in got[1].message, got[1]
    async with await pool.open_session() as session:
        r = await session.run("s = input()\nlen(s)", stdin="\ud800")
        assert (r.status, r.stdout) == (Status.OK, "6\n"), r
        assert (await session.run("s")).stdout == "'\\\\ud800'\n", "the session lives on"


@session_loop
async def test_large_stdin_with_small_memory_is_refused_and_the_slot_survives(pool, service):
    async with _http(service) as http:
        resp = await http.post(
            "/run",
            json={"code": "print(len(input()))", "stdin": "x" * (40 << 20), "limits": {"memory_mb": 64}},
        )
        assert resp.status_code == 413 and "stdin" in resp.json()["error"], resp.text
    r = await pool.run(
        "import sys\nprint(len(sys.stdin.read()))", stdin="y" * (30 << 20), limits={"memory_mb": 64}
    )
    assert r.status in (Status.OK, Status.MEMORY_LIMIT), r
    assert (await pool.run("print('alive')")).stdout == "alive\n"


@session_loop
async def test_each_slot_has_at_most_one_cpu(pool):
    groups = [g for g in pool._cgroups if g.cpu_dir]
    if not groups:
        pytest.skip("no cpu cgroup controller here")
    for g in groups:
        quota = Path(g.cpu_dir, "cpu.max" if g.v2 else "cpu.cfs_quota_us").read_text().split()[0]
        period = (
            Path(g.cpu_dir, "cpu.max").read_text().split()[1]
            if g.v2
            else Path(g.cpu_dir, "cpu.cfs_period_us").read_text()
        )
        assert int(quota) == int(period), (quota, period)
    r = await pool.run("x = 0\nfor i in range(10**6):\n    x += i")
    assert r.extra["slot_cpu_ms"] > 0, r.extra


def _http(service, **kw) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {service.token}"}
    return httpx.AsyncClient(base_url=service.endpoints[0], headers=headers, timeout=60, **kw)


ALL = ("/run", "/run/batch", "/run_code")


@session_loop
@pytest.mark.parametrize(
    ("body", "content_type", "paths", "status"),
    [
        (
            b'{"code": "print(1)"}',
            "application/x-www-form-urlencoded",
            ("/run", "/run_code"),
            200,
        ),  # `curl -d`
        (b'{"code": "print(1)"}', None, ("/run", "/run_code"), 200),
        (b'{"calls": [{"code": "print(1)"}]}', "text/plain", ("/run/batch",), 200),
        (b"code=print(1)", "application/x-www-form-urlencoded", ALL, 400),
        (b"\xff\xfe", "application/json", ALL, 400),
        (b'{"code": "1", "timeout": NaN}', "application/json", ALL, 400),
        (
            b'{"code": "1", "timeout": 1e999, "run_timeout": 1e999}',
            "application/json",
            ("/run", "/run_code"),
            422,
        ),
        (b'{"code": "1", "limits": {"memory_mb": 1e400}}', "application/json", ("/run",), 422),
        (b'{"calls": [{"code": "1", "timeout": Infinity}]}', "application/json", ("/run/batch",), 400),
        (b"[" * 100000, "application/json", ALL, 400),
        (b'"just a string"', "application/json", ALL, 422),
    ],
)
async def test_bad_bodies_get_4xx_never_500(service, body, content_type, paths, status):
    headers = {"content-type": content_type} if content_type else {}
    async with _http(service) as http:
        for path in paths:
            resp = await http.post(path, content=body, headers=headers)
            assert resp.status_code == status, (path, resp.status_code, resp.text)
            assert status == 200 or "error" in resp.json()


@session_loop
async def test_http_guard(service):
    url = service.endpoints[0]
    async with httpx.AsyncClient(base_url=url, timeout=30) as anonymous:
        health = await anonymous.get("/health")  # no token needed, nothing sensitive
        assert health.status_code == 200 and health.json()["status"] == "ok"
        for path in ("/docs", "/openapi.json", "/redoc"):
            assert (await anonymous.get(path)).status_code in (401, 404), path
        assert (await anonymous.post("/run", json={"code": "1"})).status_code == 401
        assert (await anonymous.get("/metrics")).status_code == 401
    async with _http(service) as http:
        for path in ("/docs", "/openapi.json", "/redoc"):
            assert (await http.get(path)).status_code == 404, path

        async def chunks():
            for _ in range(65):
                yield b"x" * (1 << 20)

        resp = await http.post("/run", content=chunks())  # chunked, no Content-Length
        assert resp.status_code == 413, resp.text
        batch = {"calls": [{"code": "1", "limits": {"keep_bytes": 1 << 20}}] * 200}
        resp = await http.post("/run/batch", json=batch)
        assert resp.status_code == 413 and "keep_bytes" in resp.json()["error"], resp.text


@session_loop
async def test_slow_headers_are_cut_off(service):
    """A slowloris connection (headers never finished) is closed by the server; it does not wait forever."""
    from tirl.sandbox import server

    host, port = service.endpoints[0].removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /run HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), server.HEADER_TIMEOUT_S + 30)  # EOF once the server closes
    assert b"200" not in data
    writer.close()


def test_host_header_is_checked_without_a_token():
    """DNS rebinding: a web page's request carries the attacker's Host name; without a token it is refused."""
    from starlette.testclient import TestClient

    from tirl.sandbox import Sandbox
    from tirl.sandbox.server import create_app

    app = create_app(Sandbox(slots=1, isolate=False, preload=[], warmup=[]), token=None)
    with TestClient(app, base_url="http://127.0.0.1:8080") as local:
        assert local.get("/health").status_code == 200
        evil = local.get("/health", headers={"host": "attacker.example:8080"})
        assert evil.status_code == 421 and "not this service" in evil.json()["error"]
        assert (
            local.post("/run", json={"code": "print(1)"}, headers={"host": "localhost:8080"}).json()["stdout"]
            == "1\n"
        )


def test_limits_beyond_the_machine_are_refused():
    from tirl.sandbox.limits import fitting_memory_mb, host_memory_bytes
    from tirl.sandbox.server import check_fits_machine

    total = host_memory_bytes()
    if total is None:
        pytest.skip("no /proc/meminfo")
    with pytest.raises(ValueError, match="exceed this machine"):
        check_fits_machine(2, total // (1 << 20))
    check_fits_machine(2, fitting_memory_mb(2))
