"""`tirl view --serve` behind tirl's HTTP guard: the page holds every trajectory it shows (problems,
code, answers), so a DNS-rebinding web page (a real headless Chromium whose attacker name resolves to
127.0.0.1) must not read it, and requests naming another host or coming from another origin are
refused; the page itself still opens for the user on localhost."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.view.browser import need_browser
from tests.view.rebinding import attacker_chromium, read_after_rebinding

from tirl.view.serve import make_server

SECRET = "SECRET-TRAJECTORY-7731"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[int]:
    page = tmp_path / "view.html"
    page.write_text(f"<!doctype html><title>tirl view</title><body>{SECRET}</body>")
    server = make_server(page, "127.0.0.1", 0, allowed_hosts=["viewer.lan"])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_only_this_machines_names_are_served(served):
    url = f"http://127.0.0.1:{served}/"
    assert SECRET in httpx.get(url).text
    for host in ("localhost", f"localhost:{served}", "viewer.lan"):  # loopback, and --allow-host
        assert SECRET in httpx.get(url, headers={"Host": host}).text
    for host in ("rebind.test", f"attacker.example:{served}", ""):
        resp = httpx.get(url, headers={"Host": host})
        assert resp.status_code == 421 and SECRET not in resp.text, host
    resp = httpx.get(url, headers={"Origin": "http://attacker.example"})
    assert resp.status_code == 403 and SECRET not in resp.text


def test_a_dns_rebinding_page_cannot_read_the_viewer(served):
    need_browser("the viewer's browser tests")
    with attacker_chromium() as browser:
        read = read_after_rebinding(
            browser,
            served,
            """fetch("/").then(r => r.text()).then(t => { window.results.read = t; })
  .catch(e => { window.results.read = "refused: " + e; })
  .finally(() => { window.results.done = true; });""",
        )
    assert SECRET not in read, read[:300]
    assert "not this service" in read, read[:300]
