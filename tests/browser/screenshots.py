"""Screenshots of each playground view for the README, taken against a running server.

    .venv/bin/ordinal serve --port 8765 &     # the shipped checkpoints
    .venv/bin/python -m tests.browser.screenshots --url http://127.0.0.1:8765 --out docs/playground
    .venv/bin/python -m tests.browser.screenshots --url http://127.0.0.1:8765 --only encodings

Not a test: the pictures depend on the shipped models, and a person looks at them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

from tests.browser.pages import launch, open_encodings, open_inside, set_value

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks? It is the"


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
    open_inside(page, model, PROMPT)
    page.select_option("#layer", "1")
    page.wait_for_timeout(500)
    page.screenshot(path=out / name, full_page=True)


def encodings(page: Page, out: Path, model: str, name: str) -> None:
    open_encodings(page, model)
    page.wait_for_function(  # the report's figures have loaded
        "[...document.querySelectorAll('#figures img')].every(i => i.complete && i.naturalWidth)",
        timeout=30_000,
    )
    page.screenshot(path=out / name, full_page=True)


SHOTS = {
    "generate": lambda page, out: generate(page, out),
    "inside": lambda page, out: [
        inside(page, out, model, f"inside-{model}.png") for model in ("rope", "alibi", "learned")
    ],
    "encodings": lambda page, out: encodings(page, out, "alibi", "encodings.png"),
    "compare": lambda page, out: compare(page, out),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8765")
    parser.add_argument("--out", type=Path, default=Path("docs/playground"))
    parser.add_argument(
        "--only", nargs="+", choices=sorted(SHOTS), default=list(SHOTS), help="views to shoot"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = launch(playwright)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        for view in args.only:
            page.goto(args.url + "/")  # each view from a fresh page
            page.wait_for_selector("body[data-ready=true]")
            SHOTS[view](page, args.out)
        browser.close()
    for path in sorted(args.out.glob("*.png")):
        print(path, path.stat().st_size)


if __name__ == "__main__":
    main()
