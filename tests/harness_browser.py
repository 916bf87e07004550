"""Debian's headless Chromium driven by Playwright, for dashboard tests and the dashboard benchmark.

The browser is the system's ``/usr/bin/chromium`` (``apt-get install -y chromium``); Playwright never
downloads one. Each test gets a fresh browser context (its own cookies and storage) in one browser
per session, and a ``WatchedPage`` that records console errors and uncaught exceptions and writes
screenshots under ``artifacts/screenshots/``.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("TOKENTRACE_CHROMIUM", "/usr/bin/chromium")
#: No network beyond the page under test, no first-run work, no GPU (headless servers have none).
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1366, "height": 860}  # a common laptop screen
SCREENSHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "screenshots"


@contextlib.contextmanager
def launch_chromium() -> Iterator:
    """A Playwright Browser on Debian's Chromium (a fresh temporary profile each launch)."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"Debian's Chromium is not at {CHROMIUM}: install it with 'apt-get install -y chromium'")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


class WatchedPage:
    """A page that remembers every console error and uncaught exception."""

    def __init__(self, context):
        self.context = context
        self.page = context.new_page()
        self.errors: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))

    def _console(self, message) -> None:
        if message.type in ("error", "assert"):
            self.errors.append(f"console {message.type}: {message.text} ({message.location.get('url')})")

    def open(self, url: str, status: int = 200):
        """Navigate and wait for the load event; fails unless the page answered ``status``."""
        response = self.page.goto(url, wait_until="load")
        assert response is not None and response.status == status, (
            f"{url} answered {response.status if response else None}, expected {status}")
        return response

    def screenshot(self, name: str) -> Path:
        """A full-page PNG under artifacts/screenshots/ (a test artifact)."""
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / (re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".png")
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def assert_clean(self) -> None:
        """No console error or uncaught exception so far."""
        assert not self.errors, "browser errors:\n" + "\n".join(self.errors)


@pytest.fixture(scope="module")
def chromium():
    """One headless Chromium per test module. Not per session: Playwright's sync API keeps an event
    loop running on the main thread while it is started, and later modules that call asyncio.run()
    (the gateway's, the adapters') would fail on it."""
    with launch_chromium() as browser:
        yield browser


@pytest.fixture
def browser_page(chromium) -> Iterator[WatchedPage]:
    """A page in a fresh context (no cookies from other tests) at a laptop's screen size."""
    context = chromium.new_context(viewport=VIEWPORT)
    try:
        yield WatchedPage(context)
    finally:
        context.close()
