"""A headless Chromium as a web attacker drives it (the harness of the HTTP guard's browser tests): the
attacker's host names resolve to 127.0.0.1, as a DNS-rebinding attacker sets its DNS record, and a
page can be served under such a name on the port of the server under attack."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tests.view.browser import FLAGS, find_chromium

ATTACKER_NAMES = ("attacker.test", "rebind.test")
RESOLVE = "--host-resolver-rules=" + ", ".join(f"MAP {name} 127.0.0.1" for name in ATTACKER_NAMES)
# Chromium's own Local Network Access checks would block a public page's requests to loopback before
# the server sees them; they ask the user, who may allow, and other browsers do not have them. Off, so
# the server's guard is what is tested.
NO_LNA = (
    "--disable-features=LocalNetworkAccessChecks,BlockInsecurePrivateNetworkRequests,"
    "PrivateNetworkAccessSendPreflights"
)


@contextmanager
def attacker_chromium() -> Iterator:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=find_chromium(), headless=True, args=[*FLAGS, RESOLVE, NO_LNA]
        )
        try:
            yield browser
        finally:
            browser.close()


def read_after_rebinding(browser, port: int, script: str, timeout_ms: int = 60_000) -> str:
    """Open a page at http://rebind.test:PORT/ (its document sent by the attacker before the name
    flipped to 127.0.0.1), run `script` (which sets window.results.read and .done), return what it read.
    Every request the page makes after its document goes to the server on PORT, Host: rebind.test."""
    origin = f"http://rebind.test:{port}"
    html = f"<!doctype html><body><script>window.results = {{}};\n{script}\n</script></body>"
    page = browser.new_page()
    try:
        page.route(
            f"{origin}/attack", lambda route: route.fulfill(status=200, content_type="text/html", body=html)
        )
        page.goto(f"{origin}/attack")
        page.wait_for_function("window.results && window.results.done === true", timeout=timeout_ms)
        return page.evaluate("window.results.read")
    finally:
        page.close()
