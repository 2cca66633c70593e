"""A real Chromium (Debian's ``chromium``, driven by Playwright's Python package through
``executable_path``; Playwright's own browser downloads are never used) against a real server of
the tiny checkpoints. Without chromium these tests skip, except under CI, where they fail."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.browser.pages import CHROMIUM, launch
from tests.server.conftest import Running, running_server, test_settings

LOCAL_HOSTS = {"127.0.0.1", "localhost", "[::1]", "::1"}


def _missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: the browser tests must run; `make test` installs it)")
    pytest.skip(f"{reason}: install it with `apt-get install chromium` (`make test` does)")


# Module-scoped: Playwright's sync API runs an event loop on this thread while it is open, and
# later tests that call asyncio.run() must not find it running.
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        _missing(f"no Chromium at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright package is not installed (it is in the dev extra)")
    with sync_playwright() as playwright:
        chromium = launch(playwright)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def playground(checkpoints: Path) -> Iterator[Running]:
    settings = test_settings(checkpoints, max_batch_size=8, max_queue=64, stream_interval=0)
    with running_server(settings) as running:
        yield running


@dataclass
class Watched:
    """A page, and what it did that a test must not see: console errors, outside requests."""

    page: Any
    url: str
    errors: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)
    requests: list[Any] = field(default_factory=list)

    def open(self) -> Any:
        self.page.goto(self.url)
        self.page.wait_for_selector("body[data-ready=true]")
        return self.page


@pytest.fixture
def viewport() -> dict[str, int]:
    """The window size; a test parametrizes it to run at another (a phone: 390 × 844)."""
    return {"width": 1400, "height": 900}


@pytest.fixture
def watched(browser: Any, playground: Running, viewport: dict[str, int]) -> Iterator[Watched]:
    context = browser.new_context(viewport=viewport, has_touch=viewport["width"] < 800)
    page = context.new_page()
    watched = Watched(page, playground.url + "/")

    def on_request(request: Any) -> None:
        watched.requests.append(request)
        parts = urlsplit(request.url)
        if parts.scheme not in ("data", "blob") and parts.hostname not in LOCAL_HOSTS:
            watched.outside.append(request.url)

    page.on("request", on_request)
    page.on("console", lambda m: m.type == "error" and watched.errors.append(m.text))
    page.on("pageerror", lambda error: watched.errors.append(str(error)))
    yield watched
    context.close()
    assert watched.errors == [], watched.errors
    assert watched.outside == [], watched.outside
