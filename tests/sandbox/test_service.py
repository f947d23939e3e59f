"""The HTTP service (a real `tirl sandbox serve` subprocess) and the client, end to end."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tirl.sandbox import ExecResult, SandboxClient, Status

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _http(service) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=service.endpoints[0], headers={"Authorization": f"Bearer {service.token}"}, timeout=30
    )


async def test_run_and_batch_through_the_client(service):
    r = await service.run("import sympy as sp\nx = sp.Symbol('x')\nsp.factor(x**2 - 1)")
    assert (r.status, r.stdout) == (Status.OK, "(x - 1)*(x + 1)\n")
    results = await service.run_batch(
        [{"code": f"print({i})", "stdin": ""} for i in range(40)] + [{"code": "1/0"}]
    )
    assert [r.stdout for r in results[:40]] == [f"{i}\n" for i in range(40)]
    assert (
        results[-1].status == Status.RUNTIME_ERROR
        and results[-1].message == "ZeroDivisionError: division by zero"
    )
    r = await service.run("print(input()[::-1])", stdin="olleh\n")
    assert r.stdout == "hello\n"


async def test_sandboxfusion_format(service):
    async with _http(service) as http:
        ok = (
            await http.post(
                "/run_code",
                json={
                    "code": "print(1+1)",
                    "language": "python",
                    "run_timeout": 5,
                    "compile_timeout": 5,
                    "files": {},
                    "fetch_files": [],
                },
            )
        ).json()
        assert ok["status"] == "Success"
        assert ok["run_result"]["status"] == "Finished" and ok["run_result"]["return_code"] == 0
        assert ok["run_result"]["stdout"] == "2\n" and ok["run_result"]["execution_time"] > 0
        bad = (
            await http.post("/run_code", json={"code": "raise KeyError('k')", "language": "python"})
        ).json()
        assert bad["status"] == "Failed" and bad["run_result"]["return_code"] == 1
        assert "KeyError: 'k'" in bad["run_result"]["stderr"]
        slow = (await http.post("/run_code", json={"code": "while True: pass", "run_timeout": 0.5})).json()
        assert slow["status"] == "Failed" and slow["run_result"]["status"] == "TimeLimitExceeded"


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/run", b"{not json", 400, "not JSON"),
        ("/run", b'{"code": 5}', 422, "body.code"),
        ("/run", b'{"code": "1", "timeout": "soon"}', 422, "body.timeout"),
        ("/run", b'{"code": "1", "timeout": -1}', 422, "greater than 0"),
        ("/run", b'{"stdin": ""}', 422, "body.code: Field required"),
        ("/run", b'{"code": "1", "language": "cpp"}', 400, "unsupported language 'cpp'"),
        ("/run_code", b'{"code": "int main(){}", "language": "cpp"}', 400, "Python only"),
        ("/run_code", b'{"code": "1", "files": {"a.txt": "eA=="}}', 400, "files"),
        ("/run/batch", b'{"calls": [{"code": 1}]}', 422, "body.calls.0.code"),
        ("/run", b'{"code": "1", "limits": {"memory_mb": 1}}', 422, "memory_mb"),
    ],
)
async def test_garbage_requests_get_clear_4xx(service, path, body, status, message):
    async with _http(service) as http:
        resp = await http.post(path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    text = resp.json().get("error") or resp.json().get("detail")
    assert message in str(text), text


def _rejected(metrics: str) -> float:
    return sum(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("tirl_sandbox_bad_requests_total")
    )


async def test_a_session_cell_is_refused_as_every_route_refuses(service):
    """POST /sessions/{id}/run is served before FastAPI's routing (server._SessionCells): its guard,
    its refusals and their count are still the service's."""
    async with _http(service) as http:
        opened = await http.post("/sessions", json={})
        run = f"/sessions/{opened.json()['session']}/run"
        before = _rejected((await http.get("/metrics")).text)
        cases = [
            (run, b"{not json", 400, "not JSON"),
            (run, b'{"code": 5}', 422, "body.code"),
            (run, b'{"code": "1", "language": "cpp"}', 400, "unsupported language"),
            (run, b'{"code": "1", "limits": {"memory_mb": 64}}', 422, "set when it is opened"),
            ("/sessions/nope/run", b'{"code": "1"}', 404, "no live session 'nope'"),
        ]
        for path, body, status, message in cases:
            resp = await http.post(path, content=body, headers={"content-type": "application/json"})
            assert (resp.status_code, message in resp.json()["error"]) == (status, True), (path, resp.text)
        assert _rejected((await http.get("/metrics")).text) == before + len(cases)
        assert (await http.get(run)).status_code == 405
        ok = await http.post(run, json={"code": "x = 6 * 7\nx"})
        assert (ok.status_code, ok.json()["stdout"], ok.json()["status"]) == (200, "42\n", "ok")
        await http.delete(run.removesuffix("/run"))
    async with httpx.AsyncClient(base_url=service.endpoints[0]) as anonymous:
        resp = await anonymous.post(run, json={"code": "print(1)"})
    assert resp.status_code == 401, "the token is checked before a cell is looked at"


async def test_huge_body_is_refused(service):
    async with _http(service) as http:
        resp = await http.post(
            "/run",
            content=b'{"code": "' + b"x" * (65 << 20) + b'"}',
            headers={"content-type": "application/json"},
        )
        assert resp.status_code == 413 and "too large" in resp.json()["error"]
        assert (await http.get("/health")).status_code == 200


async def test_auth_is_required(service):
    async with httpx.AsyncClient(base_url=service.endpoints[0]) as http:
        resp = await http.post("/run", json={"code": "print(1)"})
        assert resp.status_code == 401 and "bearer token" in resp.json()["error"]


async def test_overload_answers_429_quickly_and_stays_healthy(service):
    async with _http(service) as http:
        # The hogs outlast the queue deadline (1.5 s) many times over, even on a loaded machine.
        hogs = [
            asyncio.create_task(http.post("/run", json={"code": "import time; time.sleep(8)"}))
            for _ in range(2)
        ]
        deadline = time.monotonic() + 60  # a hang guard: wait for the event (both slots busy), not a time
        while (await http.get("/health")).json()["busy"] < 2:
            assert time.monotonic() < deadline, "the two hogs never occupied both slots"
            await asyncio.sleep(0.02)
        resp = await http.post("/run", json={"code": "print(1)"})
        assert resp.status_code == 429 and resp.json()["status"] == "queue_timeout"
        health = (await http.get("/health")).json()
        assert health["status"] == "ok" and health["slots"] == 2 and health["busy"] == 2
        assert not any(h.done() for h in hogs)  # answered by the queue deadline, not after the hogs
        assert [(await h).status_code for h in hogs] == [200, 200]
        metrics = (await http.get("/metrics")).text
    assert 'tirl_sandbox_calls_total{status="queue_timeout"}' in metrics
    assert "tirl_sandbox_call_seconds_bucket" in metrics and "tirl_sandbox_queue_depth" in metrics


async def test_health_reports_active_isolation(service):
    async with _http(service) as http:
        features = (await http.get("/health")).json()["features"]
    active = features["active"]
    if active["mode"] == "root":
        # all on; only what the environment forbids may be missing (e.g. CAP_SYS_RESOURCE in a container)
        assert all("OOM killer" in m for m in features["missing"]), features["missing"]
        assert all(
            active[k]
            for k in (
                "pid_namespace",
                "mount_namespace",
                "readonly_root",
                "per_slot_uid",
                "seccomp_denylist",
                "cgroup_memory",
                "cgroup_pids",
            )
        )
        assert active["network"] == "per-slot empty netns" and active["allowlisted_root"]
    else:
        assert features["missing"], "a weaker sandbox must say what is missing"


async def test_client_balances_over_endpoints_and_skips_dead_ones(service):
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    async with SandboxClient(
        [dead, *service.endpoints], token=service.token, retries=3, backoff_s=0.05
    ) as client:
        results = await client.run_batch([{"code": f"print({i})"} for i in range(30)])
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(30)]
        health = await client.health()
        assert health[0]["down"] and "error" in health[0] and health[1]["health"]["status"] == "ok"


async def test_infrastructure_failure_is_never_a_program_error():
    async with SandboxClient("http://127.0.0.1:9", retries=2, backoff_s=0.01, cooldown_s=0.01) as client:
        r: ExecResult = await client.run("print(1)")
    assert r.status == Status.SANDBOX_ERROR and r.is_infra_error
    assert "after 3 attempts" in r.message and r.stdout == ""


async def test_open_executor_remote_mode(service):
    from tirl.sandbox import SandboxConfig, open_executor

    cfg = SandboxConfig(mode="remote", endpoints=service.endpoints, token=service.token)
    async with open_executor(cfg) as executor:
        assert (await executor.run("print('remote')")).stdout == "remote\n"
    with pytest.raises(ValueError, match="needs endpoints"):
        async with open_executor(SandboxConfig(mode="remote")):
            pass


# `graphlib` is in no default preload (nor imported by numpy, sympy or scipy); sympy is in the heavy one;
# `statistics` is in the default's stdlib part, which no zygote imports on its own.
LOADED = "import sys\nprint({probe!r} in sys.modules, 'sympy' in sys.modules)"
LOADED_WITH_NUMPY = "import numpy\n" + LOADED


@pytest.mark.parametrize(("preload", "probe"), [(["graphlib"], "graphlib"), ("stdlib", "statistics")])
@pytest.mark.parametrize("mode", ["inprocess", "local"])
async def test_preload_is_what_each_slot_imports(mode, preload, probe, service):
    """`sandbox.preload` replaces the default (numpy, sympy, scipy) in both modes that start slots, as a
    list or as "stdlib" (the demo's): it starts fast and still runs code that imports numpy."""
    from tirl.sandbox import SandboxConfig, open_executor

    assert (await service.run(LOADED_WITH_NUMPY.format(probe="graphlib"))).stdout == "False True\n"  # heavy
    cfg = SandboxConfig(mode=mode, slots=1, timeout_s=10.0, memory_mb=512, preload=preload)
    async with open_executor(cfg) as executor:
        assert (await executor.run(LOADED.format(probe=probe))).stdout == "True False\n"
        assert (await executor.run(LOADED_WITH_NUMPY.format(probe=probe))).stdout == "True False\n"


async def test_stdlib_preload_is_the_defaults_standard_library_part():
    """One list to maintain (zygote.PRELOAD): "stdlib" keeps its standard-library modules, in its order,
    and a pool preloading only those needs no light twin."""
    from tirl.sandbox import Sandbox, zygote
    from tirl.sandbox.pool import resolve_preload, stdlib_part

    # a submodule is judged by its package: the light twin loads os.path, never scipy.linalg
    assert stdlib_part(["json", "os.path", "numpy", "scipy.linalg", "xml.etree"]) == [
        "json",
        "os.path",
        "xml.etree",
    ]
    stdlib = resolve_preload("stdlib")
    assert stdlib == [m for m in zygote.PRELOAD if m.split(".")[0] not in ("numpy", "sympy", "scipy")]
    assert resolve_preload(None) == list(zygote.PRELOAD)
    async with Sandbox(slots=1, preload="stdlib", warmup=[]) as sb:
        assert sb._heavy_config["preload"] == stdlib and sb._light_config is None
    with pytest.raises(ValueError, match="'numpy' is neither a list of modules nor 'stdlib'"):
        resolve_preload("numpy")


def test_preload_names_a_missing_module_in_one_line():
    from pydantic import ValidationError

    from tirl.sandbox import Sandbox, SandboxConfig

    with pytest.raises(ValidationError, match=r"preload: no module named 'no_such_mod', 'nope\.sub' on this"):
        SandboxConfig(preload=["math", "no_such_mod", "nope.sub"])
    with pytest.raises(ValueError, match="no module named ''"):
        Sandbox(slots=1, preload=[""])
    SandboxConfig(preload=["scipy.optimize", "math"])  # a submodule of an installed package


def test_serve_command_passes_the_preload():
    from tirl.sandbox import SandboxConfig
    from tirl.sandbox.service import serve_command

    def preload_flag(cfg):
        argv = serve_command(cfg, "127.0.0.1", 1)
        return argv[argv.index("--preload") + 1] if "--preload" in argv else None

    assert preload_flag(SandboxConfig()) is None  # the server's default
    assert preload_flag(SandboxConfig(preload=["math", "csv"])) == "math,csv"
    assert preload_flag(SandboxConfig(preload=[])) == ""  # nothing preloaded, not the default
    assert preload_flag(SandboxConfig(preload="stdlib")) == "stdlib"
