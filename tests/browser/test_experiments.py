"""The playground's second edition in Chromium, at a desktop and a phone size: every view fits
the window and passes axe-core (vendored, injected here; the page never loads it); the URL
keeps the view (reload restores it, Back returns); a head switch at 256 tokens draws in under
200 ms; the position offset moves learned's next-token bars and not rope's; a sampling slider
never re-fetches attention; the sampling stages keep their text size on a phone, and rope's
rotation chart names the positions an offset moved the prompt to."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest

from tests.browser.conftest import Watched
from tests.browser.pages import drawn, open_inside, set_value
from tests.server.conftest import Running, running_server, test_settings

PROMPT = "To be, or not to be, that is the question"
AXE = Path(__file__).parents[2] / "server/static/vendor/axe.v4.14.1.min.js"
SIZES = [{"width": 1400, "height": 900}, {"width": 390, "height": 844}]
BARS = "#stages-chart svg g[aria-label=bar] rect"
PATCH = {"clean": PROMPT, "corrupted": "No" + PROMPT[2:]}  # one length under the tiny tokenizer
VIEWS = {  # each view through its URL, and what shows it has drawn
    "generate": ("?view=generate&model=rope", "#view-generate:not([hidden])"),
    "compare": ("?view=compare&models=rope,alibi", "#view-compare:not([hidden])"),
    # the lens, and after it the score's parts and the logit's attribution (drawn last)
    "inside": ("?view=inside&model=alibi&lens=1", "#attribution-chart svg"),
    "encodings": ("?view=encodings&model=alibi", "#requirements-table table"),
    "length": ("?view=length&models=rope,alibi", "#length-chart svg"),
    "patch": (f"?view=patch&model=rope&{urlencode(PATCH)}", "#patch-grid table"),
}


def fits(page: Any) -> bool:
    return page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")


def violations(page: Any) -> list[dict[str, Any]]:
    """axe-core's violations on the page as it is now (its default WCAG 2 A/AA rules)."""
    if not page.evaluate("typeof axe !== 'undefined'"):
        page.add_script_tag(path=str(AXE))
    found = page.evaluate("axe.run(document).then(r => r.violations)")
    return [
        {"id": v["id"], "nodes": [n["target"] for n in v["nodes"]][:5], "help": v["help"]}
        for v in found
    ]


@pytest.mark.parametrize("viewport", SIZES, ids=["desktop", "phone"])
def test_every_view_fits_the_window_and_passes_axe(
    watched: Watched, viewport: dict[str, int]
) -> None:
    page = watched.open()
    problems: dict[str, Any] = {}  # every view's, so that one run shows them all
    for view, (query, ready) in VIEWS.items():
        page.goto(watched.url + query)
        page.wait_for_selector(ready, state="attached", timeout=30_000)
        if view == "compare":
            page.click("#compare")
            page.wait_for_selector("#compare:not([disabled])", timeout=60_000)
            assert page.locator("#columns .ended").count() == 2
            lines = page.locator("#compare-curves svg g[aria-label=line] path")
            assert lines.count() == 2  # both models on one shared chart
        if view == "encodings":
            page.wait_for_selector("#encoding-chart svg", timeout=30_000)
        if not fits(page):
            problems[f"{view}: scrolls sideways"] = page.evaluate(
                "document.documentElement.scrollWidth"
            )
        if found := violations(page):
            problems[view] = found
    assert not problems, json.dumps(problems, indent=1)
    if viewport["width"] < 800:  # the settings fold away behind a button, and come back
        assert not page.is_visible("#settings")
        page.tap("#settings-toggle")
        assert page.is_visible("#model")
        for view in VIEWS:  # every tab is on screen and answers a tap
            page.tap(f"button[data-view={view}]")
            page.wait_for_selector(f"#view-{view}:not([hidden])")
        assert fits(page)


def test_the_url_keeps_the_view_reload_restores_it_and_back_returns(watched: Watched) -> None:
    page = watched.open()
    open_inside(page, "learned", PROMPT)
    set_value(page, "#offset", 3)
    page.wait_for_function("document.querySelector('#offset-effect').dataset.tv > 0")
    page.select_option("#head", "2")
    assert "view=inside" in page.url and "offset=3" in page.url and "head=2" in page.url
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    page.wait_for_function("document.querySelector('#offset-effect').dataset.tv > 0")
    assert page.is_visible("#view-inside")
    assert page.input_value("#model") == "learned" and page.input_value("#offset") == "3"
    assert page.input_value("#prompt") == PROMPT and page.input_value("#head") == "2"
    page.click("button[data-view=compare]")
    assert "view=compare" in page.url
    page.go_back()
    page.wait_for_selector("#view-inside:not([hidden])")
    assert page.is_hidden("#view-compare") and page.input_value("#offset") == "3"
    page.go_forward()
    page.wait_for_selector("#view-compare:not([hidden])")


def widths(page: Any) -> list[float]:
    return page.eval_on_selector_all(BARS, "rs => rs.map(r => +r.getAttribute('width'))")


@pytest.mark.parametrize("viewport", SIZES, ids=["desktop", "phone"])
def test_stage_bars_keep_their_text_size_and_ropes_angles_their_positions(
    watched: Watched, viewport: dict[str, int]
) -> None:
    """Panel 4's stages sit side by side where they fit and one above the next on a phone,
    never shrunk to fit (their 11 px text would be 5 px); the rotation chart names the
    positions the prompt took, moved by the offset."""
    page = watched.open()
    page.goto(watched.url + "?view=inside&model=rope&offset=20")  # the settings fold on a phone
    page.wait_for_selector(BARS, state="attached", timeout=30_000)
    charts = page.eval_on_selector_all(
        "#stages-chart svg[width]",
        "svgs => svgs.map(s => [s.getBoundingClientRect().width, +s.getAttribute('width')])",
    )
    assert len(charts) == (1 if viewport["width"] > 800 else 4)
    assert all(shown >= drawn_at - 1 for shown, drawn_at in charts), charts
    ticks = page.evaluate(
        """[...document.querySelectorAll('figure')]
        .filter(f => f.textContent.includes('rotation angle'))
        .flatMap(f => [...f.querySelectorAll('g[aria-label="y-axis tick label"] text')])
        .map(t => t.textContent)"""
    )
    tokens = int(page.inner_text("#trace-stats").split()[0])
    labelled = [int(tick) for tick in ticks if tick]  # every 2nd or 16th position is named
    assert labelled and all(20 <= position < 20 + tokens for position in labelled), ticks


@pytest.mark.parametrize(("model", "moves"), [("learned", True), ("rope", False)])
def test_the_offset_slider_moves_learneds_bars_and_not_ropes(
    watched: Watched, model: str, moves: bool
) -> None:
    page = watched.open()
    set_value(page, "#temperature", 1)  # the bars are then the model's own distribution
    open_inside(page, model, PROMPT)
    page.wait_for_selector(BARS, state="attached")
    before, count = widths(page), drawn(page, "#stages-chart")
    set_value(page, "#offset", 20)
    page.wait_for_function(f"+document.querySelector('#stages-chart').dataset.drawn > {count}")
    page.wait_for_function("document.querySelector('#offset-effect').dataset.tv !== '0'")
    tv = float(page.get_attribute("#offset-effect", "data-tv") or "nan")
    moved = max(abs(a - b) for a, b in zip(widths(page), before, strict=True))
    if moves:  # a bar is ~300 px at probability 1: 0.5 px is a change of ~0.002
        assert tv > 1e-3 and moved > 0.5, (tv, moved)
    else:  # rope: the same bars, up to float32 rounding
        assert tv < 1e-4 and moved < 0.01, (tv, moved)


def test_the_note_beside_the_experiments_is_the_servers_claim_for_each_scheme(
    watched: Watched, playground: Running
) -> None:
    """Each scheme class declares what the experiments should show, and /v1/models sends it:
    the page shows that (for fox, cope and fire as for the first ten), never a copy of its own."""
    models = httpx.get(f"{playground.url}/v1/models").json()["data"]
    claims = {entry["id"]: entry["claim"] for entry in models}
    page = watched.open()
    for name in ("fox", "rope"):
        open_inside(page, name, PROMPT)
        assert claims[name] and page.inner_text("#prediction") == claims[name]


def test_a_sampling_slider_never_refetches_attention(watched: Watched) -> None:
    page = watched.open()
    open_inside(page, "rope", PROMPT)
    page.wait_for_selector(BARS, state="attached")
    sent = len(watched.requests)
    for value in (1.1, 1.4, 1.7):
        count = drawn(page, "#stages-chart")
        set_value(page, "#temperature", value)
        page.wait_for_function(f"+document.querySelector('#stages-chart').dataset.drawn > {count}")
    traces = [r for r in watched.requests[sent:] if r.url.endswith("/v1/trace")]
    assert traces and all(json.loads(r.post_data)["attention"] is False for r in traces)


# Timed in the page: the change handler draws synchronously, so this is the whole redraw.
SWITCH_HEAD = """head => { const started = performance.now();
const select = document.querySelector('#head'); select.value = head;
select.dispatchEvent(new Event('change')); return performance.now() - started; }"""


@pytest.fixture(scope="module")
def long_context(checkpoints: Path) -> Iterator[Running]:
    """rope alone, serving 256 tokens (the tiny checkpoints default to 4 × their 32)."""
    settings = test_settings(checkpoints, models=["rope"], max_context=256, stream_interval=0)
    with running_server(settings) as running:
        yield running


def test_a_head_switch_at_256_tokens_draws_in_under_200_ms(
    browser: Any, long_context: Running
) -> None:
    url = long_context.url
    words = (PROMPT + " ") * 40
    ids = httpx.post(f"{url}/v1/tokenize", json={"prompt": words}).json()["tokens"]
    text = httpx.post(f"{url}/v1/detokenize", json={"tokens": ids[1:256]}).json()["prompt"]
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.goto(url + "/")
    page.wait_for_selector("body[data-ready=true]")
    open_inside(page, "rope", text)
    length = int(page.inner_text("#trace-stats").split()[0])
    assert 250 <= length <= 256
    timings = []
    for head in ("1", "2", "3", "0"):
        timings.append(page.evaluate(SWITCH_HEAD, head))
        assert page.get_attribute("#attention-chart", "data-head") == head
    page.click("#heads .head-thumb >> nth=2")  # a click on a small multiple enlarges it
    assert page.get_attribute("#attention-chart", "data-head") == "2"
    context.close()
    assert max(timings) < 200, timings


def test_a_branch_is_the_completion_whose_prompt_ends_with_the_forced_token(
    watched: Watched, playground: Running
) -> None:
    page = watched.open()
    page.select_option("#model", "rope")
    set_value(page, "#prompt", PROMPT)
    set_value(page, "#max_tokens", 12)
    set_value(page, "#seed", 3)
    set_value(page, "#temperature", 1.5)  # many alternatives survive the filters
    page.click("#generate")
    page.wait_for_selector("#generate:not([disabled])")
    page.focus("#output .tok >> nth=2")  # reachable by keyboard: Enter explains it
    page.keyboard.press("Enter")
    page.wait_for_selector("#alternatives .branches button")
    forced = page.inner_text("#alternatives .branches button >> nth=0")
    page.click("#alternatives .branches button >> nth=0")
    page.wait_for_selector("#branch [data-done=true]")
    branch = page.locator("#branch [data-done=true]")
    prompt = json.loads(branch.get_attribute("data-prompt") or "[]")
    settings = page.evaluate(
        "({temperature: 1.5, top_k: +top_k.value, top_p: +top_p.value, "
        "min_p: +min_p.value, repetition_penalty: +repetition_penalty.value})"
    )
    body = {"model": "rope", "prompt": prompt, "max_tokens": 12 - 2 - 1, "seed": 3, **settings}
    expected = httpx.post(f"{playground.url}/v1/completions", json=body).json()
    shown = branch.inner_text().replace("↵", "")
    first = branch.locator(".tok.diverge").inner_text().replace("↵", "")
    assert first and first in forced  # the forced token, marked as the first difference
    assert shown == first + expected["choices"][0]["text"]
