"""A token-less `tirl sandbox serve` refuses requests a web page sent (tirl.http_guard's Origin rule),
through the real service: a page's fetch or form reaches loopback with its own Origin, and without a
token nothing else tells it from tirl's clients (which send no Origin)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from tirl import lifetime
from tirl.ports import free_port
from tirl.sandbox import SandboxConfig
from tirl.sandbox.service import serve_command

FOREIGN = ["http://attacker.example", "https://evil.test:8443", "null", "http://127.0.0.1.evil.test"]
START_TIMEOUT_S = 120.0  # zygotes start in seconds; more beside other test runs on 2 cores


@pytest.fixture(scope="module")
def tokenless() -> Iterator[str]:
    """The URL of a real `tirl sandbox serve` started without a token (as a user may run it)."""
    port = free_port()
    cfg = SandboxConfig(mode="local", slots=1, timeout_s=3.0, memory_mb=256)
    env = {k: v for k, v in os.environ.items() if k != "TIRL_SANDBOX_TOKEN"} | {
        lifetime.ENV: str(os.getpid())
    }
    proc = subprocess.Popen(serve_command(cfg, "127.0.0.1", port), env=env, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(url):
            assert proc.poll() is None, f"`tirl sandbox serve` exited with code {proc.returncode}"
            assert time.monotonic() < deadline, (
                f"`tirl sandbox serve` not healthy within {START_TIMEOUT_S:g} s"
            )
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _calls(url: str) -> float:
    """Calls the service has finished (its Prometheus counter, summed over statuses)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("tirl_sandbox_calls_total")
    )


def test_tokenless_service_serves_its_own_clients(tokenless):
    calls = _calls(tokenless)
    resp = httpx.post(f"{tokenless}/run", json={"code": "print(6 * 7)"}, timeout=60)
    assert resp.status_code == 200 and resp.json()["stdout"] == "42\n"
    assert _calls(tokenless) == calls + 1  # the counter the refusals below are checked against
    same_origin = {"Origin": tokenless}  # a page served by this very service (it serves none) may ask
    assert httpx.get(f"{tokenless}/health", headers=same_origin).status_code == 200


@pytest.mark.parametrize("origin", FOREIGN)
def test_tokenless_service_refuses_a_foreign_origin(tokenless, origin):
    calls, sessions = _calls(tokenless), httpx.get(f"{tokenless}/health").json()["sessions"]
    headers = {"Origin": origin}
    requests = [
        ("POST", "/run", {"code": "print(1)"}),
        ("POST", "/run/batch", {"calls": [{"code": "print(1)"}]}),
        ("POST", "/run_code", {"code": "print(1)", "language": "python"}),
        ("POST", "/sessions", {}),
        ("GET", "/health", None),
        ("GET", "/metrics", None),
    ]
    for method, path, body in requests:
        resp = httpx.request(method, f"{tokenless}{path}", json=body, headers=headers, timeout=60)
        assert resp.status_code == 403, (path, resp.status_code, resp.text)
        assert "origin" in resp.json()["error"], resp.text
    assert _calls(tokenless) == calls  # nothing ran
    assert httpx.get(f"{tokenless}/health").json()["sessions"] == sessions  # no session opened
