"""The browser harness of the viewer tests (and of the README screenshot): a real headless Chromium
driven by Playwright, with flags that keep it off the network, and every console error collected."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

# A fresh profile (Playwright makes one per launch) and no background connections: on a machine with
# a closed network Chromium otherwise hangs on them.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def find_chromium() -> str | None:
    """$TIRL_CHROMIUM, else the first Chromium or Chrome on PATH (Debian's package: /usr/bin/chromium)."""
    if os.environ.get("TIRL_CHROMIUM"):
        return os.environ["TIRL_CHROMIUM"]
    names = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
    return next((path for name in names if (path := shutil.which(name))), None)


def unavailable() -> str | None:
    """Why no browser test can run here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the Python package playwright is not installed (make install adds it: pip install playwright)"
    if find_chromium() is None:
        return "no Chromium on this machine (make test adds it: apt-get install --no-install-recommends chromium; or set TIRL_CHROMIUM)"
    return None


def need_browser(tests: str) -> None:
    """Skip `tests` where no browser can run, with the reason; under CI (`make test` installs one)
    fail instead: a browser test skipped there would prove nothing."""
    import pytest

    reason = unavailable()
    if reason and os.environ.get("CI"):
        pytest.fail(f"{tests} need a real browser under CI: {reason}")
    if reason:
        pytest.skip(f"{tests} need a real browser: {reason}")


@contextmanager
def chromium() -> Iterator:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=find_chromium(), headless=True, args=FLAGS)
        try:
            yield browser
        finally:
            browser.close()


class Page:
    """One page of the viewer; `errors` collects console errors and uncaught exceptions."""

    def __init__(self, browser, url: str, width: int = 1400, height: int = 900):
        self.page = browser.new_page(viewport={"width": width, "height": height})
        self.errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url)
        self.page.wait_for_selector("body[data-ready]")

    def shown(self) -> int:
        return int(self.page.get_attribute("#count", "data-shown"))

    def wait_shown(self, n: int) -> None:
        """Wait (on the page's own state, no sleeps) until the table holds n rows."""
        self.page.wait_for_function(f"document.querySelector('#count').dataset.shown === '{n}'")

    def row_ids(self) -> list[int]:
        return [int(x) for x in self.page.eval_on_selector_all(".row", "rows => rows.map(r => r.dataset.id)")]

    def close(self) -> None:
        self.page.close()
