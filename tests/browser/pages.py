"""What the browser tests and the screenshot script both do to the playground: start Debian's
Chromium, set an input as a user would, open a view and wait until it has drawn."""

from __future__ import annotations

import os
from typing import Any

CHROMIUM = os.environ.get("ORDINAL_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def launch(playwright: Any) -> Any:
    """Headless Chromium from ``CHROMIUM`` (never Playwright's own download)."""
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)


def set_value(page: Any, selector: str, value: object) -> None:
    """Set an input (slider, textarea) as a user would: new value, then an input event."""
    page.eval_on_selector(
        selector,
        "(e, v) => { e.value = v; e.dispatchEvent(new Event('input', {bubbles: true})); }",
        str(value),
    )


def drawn(page: Any, selector: str) -> int:
    """How many times the chart at ``selector`` has been drawn (its data-drawn counter)."""
    return int(page.get_attribute(selector, "data-drawn") or 0)


def open_inside(page: Any, model: str, prompt: str) -> None:
    """The Inside view on ``model`` and ``prompt``, once its trace has been drawn."""
    page.click("button[data-view=generate]")
    page.select_option("#model", model)
    set_value(page, "#prompt", prompt)
    page.click("button[data-view=inside]")
    page.wait_for_function(
        "document.querySelector('#trace-stats').textContent.includes('tokens')", timeout=30_000
    )


def open_encodings(page: Any, model: str) -> None:
    """The Encodings view on ``model``, once it has drawn that model's scheme (a drawing of an
    earlier choice that finishes later is dropped, so the stats line names the current one)."""
    page.click("button[data-view=encodings]")
    page.select_option("#model", model)
    page.wait_for_function(
        f"document.querySelector('#encodings-stats').textContent.startsWith('{model}:')",
        timeout=30_000,
    )
