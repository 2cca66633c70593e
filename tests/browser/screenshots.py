"""Screenshots of each playground view for the README, at 1400 × 900 and at a phone's 390 × 844
(``-phone`` in the name), taken against a running server.

    .venv/bin/ordinal serve --port 8765 &     # the shipped checkpoints
    .venv/bin/python -m tests.browser.screenshots --url http://127.0.0.1:8765 --out docs/playground
    .venv/bin/python -m tests.browser.screenshots --url http://127.0.0.1:8765 --only encodings

Not a test: the pictures depend on the shipped models, and a person looks at them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

from tests.browser.pages import drawn, launch, open_encodings, open_inside, set_value

PROMPT = "JULIET:\nO Romeo, Romeo! wherefore art thou"
PHONE = {"width": 390, "height": 844}
SIZES = {"": {"width": 1400, "height": 900}, "-phone": PHONE}


def shoot(page: Page, out: Path, name: str, panel: str | None = None) -> None:
    """A full-page picture (or of one panel), the settings folded away on a phone."""
    if page.evaluate("document.body.classList.contains('settings-open')"):
        page.click("#settings-toggle")
    if panel:
        page.locator(panel).screenshot(path=out / name)
    else:
        page.screenshot(path=out / name, full_page=True)


def settings(page: Page) -> None:
    """Unfold the settings where a phone folds them, so that they can be set."""
    if page.is_visible("#settings-toggle") and not page.is_visible("#model"):
        page.click("#settings-toggle")


def generate(page: Page, out: Path, suffix: str) -> None:
    settings(page)
    page.select_option("#model", "rope")
    set_value(page, "#prompt", PROMPT)
    set_value(page, "#max_tokens", 60)
    set_value(page, "#seed", 5)  # a continuation of 60 tokens on the shipped rope model
    page.click("#generate")
    page.wait_for_selector("#generate:not([disabled])", timeout=60_000)
    page.click("#output .tok:not(:empty) >> nth=3")
    page.wait_for_selector("#alternatives svg", timeout=30_000)
    page.click("#alternatives .branches button >> nth=0")
    page.wait_for_selector("#branch [data-done=true]", timeout=60_000)
    shoot(page, out, f"generate{suffix}.png")


def compare(page: Page, out: Path, suffix: str) -> None:
    page.click("button[data-view=compare]")
    settings(page)
    page.click("#no-models")
    for name in ("rope", "alibi", "none", "learned", "t5", "sinusoidal"):
        page.check(f"#compare-models input[value={name}]")
    page.click("#long-prompt")
    set_value(page, "#max_tokens", 60)
    page.click("#compare")
    page.wait_for_selector("#compare:not([disabled])", timeout=120_000)
    shoot(page, out, f"compare{suffix}.png")


def inside(page: Page, out: Path, preset: str, name: str) -> None:
    settings(page)
    open_inside(page, "rope", PROMPT)
    page.click(f"#presets button[data-preset={preset}]")
    page.wait_for_function(
        "document.querySelector('#trace-stats').textContent.includes('tokens')", timeout=30_000
    )
    page.wait_for_timeout(1500)
    shoot(page, out, name)


def redrawn(page: Page, chart: str, before: int) -> None:
    page.wait_for_function(
        f"+document.querySelector('{chart}').dataset.drawn > {before}", timeout=60_000
    )


# Inside's panel 6 on the default prompt, then panel 4 on a head that shows its scheme's claim
# (a preset each: the chart's title names the head).
PARTS = {"parts-rope": "layer 1, head 1", "parts-alibi": "layer 3, head 2"}


def parts(page: Page, out: Path, suffix: str) -> None:
    settings(page)
    open_inside(page, "rope", PROMPT)
    page.wait_for_selector("#attribution-chart svg", timeout=60_000)
    shoot(page, out, f"inside-attribution{suffix}.png", "#attribution-panel")
    for preset, head in PARTS.items():
        page.click(f"#parts-panel button[data-preset={preset}]")
        model = preset.removeprefix("parts-")
        page.wait_for_function(
            f"document.querySelector('#parts-chart').textContent.includes('{head}:') && "
            f"document.querySelector('#trace-stats').textContent.includes('{model}:')",
            timeout=60_000,
        )
        page.wait_for_timeout(1500)
        shoot(page, out, f"inside-{preset}{suffix}.png", "#parts-panel")


def patch(page: Page, out: Path, suffix: str) -> None:
    page.click("button[data-view=patch]")
    before = drawn(page, "#patch-grid")
    page.click("#patch-presets button[data-patch=alibi]")
    redrawn(page, "#patch-grid", before)
    page.wait_for_function("document.querySelector('#patch-stats').textContent.includes('alibi:')")
    shoot(page, out, f"patch{suffix}.png")


def length(page: Page, out: Path, suffix: str) -> None:
    page.click("button[data-view=length]")
    page.click("#length-presets button >> nth=0")  # alibi and t5 against rope
    page.wait_for_function(
        "document.querySelector('#length-chart').dataset.models === 'rope,alibi,t5'",
        timeout=120_000,
    )
    shoot(page, out, f"length{suffix}.png")


def encodings(page: Page, out: Path, suffix: str) -> None:
    settings(page)
    open_encodings(page, "alibi")
    # lazy images below a phone's first screen would never load: a full-page picture wants them
    page.eval_on_selector_all("#figures img", "images => images.forEach(i => i.loading = 'eager')")
    page.wait_for_function(  # the report's figures have loaded
        "[...document.querySelectorAll('#figures img')].every(i => i.complete && i.naturalWidth)",
        timeout=30_000,
    )
    shoot(page, out, f"encodings{suffix}.png")


INSIDE = {"offset-rope": "inside-rope", "offset-learned": "inside-learned", "lens": "inside-lens"}
SHOTS = {
    "generate": generate,
    "inside": lambda page, out, suffix: [
        inside(page, out, preset, f"{name}{suffix}.png") for preset, name in INSIDE.items()
    ],
    "encodings": encodings,
    "compare": compare,
    "parts": parts,
    "patch": patch,
    "length": length,
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
        for suffix, viewport in SIZES.items():
            page = browser.new_page(viewport=viewport, has_touch=viewport is PHONE)
            for view in args.only:
                page.goto(args.url + "/")  # each view from a fresh page
                page.wait_for_selector("body[data-ready=true]")
                SHOTS[view](page, args.out, suffix)
            page.close()
        browser.close()
    for path in sorted(args.out.glob("*.png")):
        print(path, path.stat().st_size)


if __name__ == "__main__":
    main()
