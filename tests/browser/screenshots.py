"""Screenshots of each playground view for the README, taken against a running server.

    .venv/bin/ordinal serve --port 8765 &     # the shipped checkpoints
    .venv/bin/python -m tests.browser.screenshots --url http://127.0.0.1:8765 --out docs/playground

Not a test: the pictures depend on the shipped models, and a person looks at them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

from tests.browser.conftest import CHROMIUM, CHROMIUM_ARGS

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks? It is the"


def set_value(page: Page, selector: str, value: object) -> None:
    page.eval_on_selector(
        selector,
        "(e, v) => { e.value = v; e.dispatchEvent(new Event('input', {bubbles: true})); }",
        str(value),
    )


def generate(page: Page, out: Path) -> None:
    page.select_option("#model", "rope")
    set_value(page, "#prompt", PROMPT)
    set_value(page, "#max_tokens", 80)
    page.click("#generate")
    page.wait_for_selector("#generate:not([disabled])", timeout=60_000)
    page.click("#output .tok:not(:empty) >> nth=3")
    page.wait_for_selector("#alternatives svg", timeout=30_000)
    page.screenshot(path=out / "generate.png", full_page=True)


def compare(page: Page, out: Path) -> None:
    page.click("button[data-view=compare]")
    page.click("#no-models")
    for name in ("rope", "alibi", "none", "learned", "t5", "sinusoidal"):
        page.check(f"#compare-models input[value={name}]")
    page.click("#long-prompt")
    set_value(page, "#max_tokens", 60)
    page.click("#compare")
    page.wait_for_selector("#compare:not([disabled])", timeout=120_000)
    page.screenshot(path=out / "compare.png", full_page=True)


def inside(page: Page, out: Path, model: str, name: str) -> None:
    page.click("button[data-view=generate]")
    page.select_option("#model", model)
    set_value(page, "#prompt", PROMPT)
    page.click("button[data-view=inside]")
    page.wait_for_function(
        "document.querySelector('#trace-stats').textContent.includes('tokens')", timeout=30_000
    )
    page.select_option("#layer", "1")
    page.wait_for_timeout(500)
    page.screenshot(path=out / name, full_page=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8765")
    parser.add_argument("--out", type=Path, default=Path("docs/playground"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(args.url + "/")
        page.wait_for_selector("body[data-ready=true]")
        generate(page, args.out)
        inside(page, args.out, "rope", "inside-rope.png")
        inside(page, args.out, "alibi", "inside-alibi.png")
        inside(page, args.out, "learned", "inside-learned.png")
        page.goto(args.url + "/")
        page.wait_for_selector("body[data-ready=true]")
        compare(page, args.out)
        browser.close()
    for path in sorted(args.out.glob("*.png")):
        print(path, path.stat().st_size)


if __name__ == "__main__":
    main()
