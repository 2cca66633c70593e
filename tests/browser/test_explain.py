"""The views that take a prediction apart, in Chromium against the tiny checkpoints (2 layers, 4
heads, trained length 32): Inside's position against content (the drawn parts add up to the
drawn score; rope's pair shares add up to it too) and its head attribution (the bars are the
logit; an ablated head's bar is 0), the Patch view's stream × position grid, and the Length
view's surprisal curves (one per model, each as long as the model serves, the trained length
marked). Each keeps its state in the URL."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from tests.browser.conftest import Watched
from tests.browser.pages import drawn, open_inside, set_value
from tests.server.conftest import CONTEXT_LENGTH, Running

PROMPT = "To be, or not to be, that is the question"
# One token apart under the tiny tokenizer (the first after <|bos|>), the same length.
CORRUPTED = "No be, or not to be, that is the question"
LAYERS, HEADS = 2, 4

# Each key's stacked bars and its dot, in pixels: the bars' signed heights from the zero line
# (up is +) and the dot's height above it; the dots' titles hold the scores drawn.
BARS_AND_DOTS = """() => {
  const svg = document.querySelector('#parts-chart figure > svg');
  const zero = +svg.querySelector('g[aria-label=rule] line').getAttribute('y1');
  const sums = new Map();
  for (const r of svg.querySelectorAll('g[aria-label=rect] rect')) {
    const middle = Math.round(+r.getAttribute('x') + +r.getAttribute('width') / 2);
    const y = +r.getAttribute('y'), h = +r.getAttribute('height');
    sums.set(middle, (sums.get(middle) ?? 0) + (y + h <= zero + 0.5 ? h : -h));
  }
  return [...svg.querySelectorAll('g[aria-label=dot] circle')].map(c => ({
    middle: Math.round(+c.getAttribute('cx')), dot: zero - +c.getAttribute('cy'),
    bars: sums.get(Math.round(+c.getAttribute('cx'))) ?? null,
    score: +c.querySelector('title').textContent.split('score ')[1],
  }));
}"""


def parts_drawn(page: Any, before: int = 0) -> None:
    page.wait_for_function(
        f"+document.querySelector('#parts-chart').dataset.drawn > {before}", timeout=30_000
    )


def tokens_of(url: str, text: str) -> int:
    return int(httpx.post(f"{url}/v1/tokenize", json={"prompt": text}).json()["count"])


def test_position_against_content_draws_parts_that_add_up_to_the_score(
    watched: Watched,
) -> None:
    page = watched.open()
    open_inside(page, "rope", PROMPT)
    parts_drawn(page)
    length = int(page.inner_text("#trace-stats").split()[0])
    keys = page.evaluate(BARS_AND_DOTS)
    assert len(keys) == length  # a dot per key
    for key in keys:  # content and position stacked reach the score's dot, to a pixel
        assert key["bars"] is not None and abs(key["bars"] - key["dot"]) < 1.0, key
    assert page.get_attribute("#parts-chart", "data-kind") == "rotation"
    # rope's map: a cell per rotation pair and key, whose titles hold the shares drawn: each
    # distance's shares add up to the score its dot shows (both written to 3 places)
    scores = {
        int(match[1]): float(match[2])
        for title in page.eval_on_selector_all(
            "#parts-chart g[aria-label=dot] title", "ts => ts.map(t => t.textContent)"
        )
        if (match := re.search(r"(\d+) back: score (\S+)$", title))
    }
    assert len(scores) == length
    sums: dict[int, float] = {}
    cells = page.eval_on_selector_all(
        "#frequency-chart g[aria-label=cell] title", "ts => ts.map(t => t.textContent)"
    )
    for title in cells:
        match = re.search(r"(\d+) back: (\S+)$", title)
        assert match, title
        sums[int(match[1])] = sums.get(int(match[1]), 0.0) + float(match[2])
    pairs = len(cells) // length
    assert pairs >= 2 and len(cells) == pairs * length
    for distance, score in scores.items():
        assert abs(sums[distance] - score) < 5e-4 * (pairs + 1), (distance, sums[distance], score)
    # Panel 4's pickers are panel 3's: choosing a head in one moves both, and the URL.
    before = drawn(page, "#parts-chart")
    page.select_option("#parts-layer", "1")
    page.select_option("#parts-head", "2")
    parts_drawn(page, before)
    assert page.input_value("#layer") == "1" and page.input_value("#head") == "2"
    assert page.get_attribute("#attention-chart", "data-layer") == "1"
    assert "layer=1" in page.url and "head=2" in page.url
    assert "layer 1, head 2" in page.inner_text("#parts-chart")


@pytest.mark.parametrize(
    ("model", "layer", "kind", "parts"),
    [
        ("alibi", "0", "bias", ["content", "position"]),
        (
            "learned",
            "0",
            "added",
            ["token·token", "token·position", "position·token", "position·position"],
        ),
        ("learned", "1", "added", ["score (not split here)"]),
    ],
)
def test_each_kind_of_scheme_splits_its_score_its_own_way(
    watched: Watched, model: str, layer: str, kind: str, parts: list[str]
) -> None:
    """alibi: content and its bias; learned at layer 0: the four terms; past layer 0 an
    additive scheme has no split: the score alone, and the server's note saying why."""
    page = watched.open()
    open_inside(page, model, PROMPT)
    parts_drawn(page)
    if layer != "0":
        before = drawn(page, "#parts-chart")
        page.select_option("#parts-layer", layer)
        parts_drawn(page, before)
    assert page.get_attribute("#parts-chart", "data-kind") == kind
    legend = page.eval_on_selector_all(
        "#parts-chart [class$='-swatch']", "s => s.map(e => e.textContent)"
    )
    assert legend == parts
    for key in page.evaluate(BARS_AND_DOTS):
        assert abs(key["bars"] - key["dot"]) < 1.0, key
    assert page.locator("#frequency-chart svg").count() == 0  # no rotation pairs
    assert page.inner_text("#frequency-chart .note")  # the server's note instead


def attribution(page: Any) -> list[tuple[str, float, float, float]]:
    """Each bar: its part's name, the value drawn, and its left and right ends, with the zero
    line's x as the last entry's third field."""
    return page.evaluate(
        """() => {
      const svg = document.querySelector('#attribution-chart figure > svg');
      const zero = +svg.querySelector('g[aria-label=rule] line').getAttribute('x1');
      const bars = [...svg.querySelectorAll('g[aria-label=bar]')].pop();
      return [...bars.querySelectorAll('rect')].map(r => {
        const [name, value] = r.querySelector('title').textContent.split(': ');
        return [name, +value, +r.getAttribute('x') - zero,
                +r.getAttribute('x') + +r.getAttribute('width') - zero];
      });
    }"""
    )


def attribution_drawn(page: Any, before: int = 0) -> None:
    page.wait_for_function(
        f"+document.querySelector('#attribution-chart').dataset.drawn > {before}",
        timeout=30_000,
    )


def test_head_attribution_bars_sum_to_the_logit_and_follow_the_target(
    watched: Watched,
) -> None:
    page = watched.open()
    open_inside(page, "rope", PROMPT)
    attribution_drawn(page)
    bars = attribution(page)
    names = [name for name, *_ in bars]
    heads = [f"L{layer}.H{head}" for layer in range(LAYERS) for head in range(HEADS)]
    assert set(heads) <= set(names) and {"embedding", "L0.mlp", "L1.mlp"} <= set(names)
    logit = float(page.get_attribute("#attribution-chart", "data-logit") or "nan")
    assert abs(sum(value for _, value, *_ in bars) - logit) < 0.01 * len(bars)
    for name, value, left, right in bars:  # up to the right of 0, down to the left
        assert (left >= -0.5) if value > 0 else (right <= 0.5), (name, value, left, right)
    top = page.eval_on_selector("#target", "s => s.options[1].textContent")
    assert top.split("”")[0].strip("“") in page.inner_text("#attribution-readout")
    # The second most probable token: its own bars, a logit no higher, and it is in the URL.
    second = page.eval_on_selector("#target", "s => s.options[2].value")
    before = drawn(page, "#attribution-chart")
    page.select_option("#target", second)
    attribution_drawn(page, before)
    assert float(page.get_attribute("#attribution-chart", "data-logit") or "nan") <= logit
    assert f"token {second})" in page.inner_text("#attribution-readout")
    assert f"target={second}" in page.url
    # An ablated head writes nothing: its bar is 0.
    before = drawn(page, "#attribution-chart")
    page.check("#ablate input[data-layer='1'][data-head='2']")
    attribution_drawn(page, before)
    ablated = dict((name, value) for name, value, *_ in attribution(page))
    assert ablated["L1.H2"] == 0.0 and any(value != 0.0 for value in ablated.values())


def open_patch(page: Any, url: str, query: str) -> None:
    page.goto(url + query)
    page.wait_for_selector("body[data-ready=true]")
    page.wait_for_function(
        "document.querySelector('#patch-grid table') || "
        "document.querySelector('#patch-readout').classList.contains('error')",
        timeout=30_000,
    )


def test_the_patch_grid_has_a_cell_per_stream_and_position(
    watched: Watched, playground: Running
) -> None:
    length = tokens_of(playground.url, PROMPT)
    assert tokens_of(playground.url, CORRUPTED) == length
    page = watched.open()
    query = "?" + str(
        httpx.QueryParams(
            {"view": "patch", "model": "rope", "clean": PROMPT, "corrupted": CORRUPTED}
        )
    )
    open_patch(page, watched.url, query)
    cells = page.eval_on_selector_all("#patch-grid tbody td", "ts => ts.map(t => t.textContent)")
    assert len(cells) == (LAYERS + 1) * length
    assert cells[-1] == "1.00"  # the last layer's stream at the last position is the clean run
    rows = page.eval_on_selector_all("#patch-grid tbody th", "ts => ts.map(t => t.textContent)")
    assert rows == ["embedding", "layer 0", "layer 1"]
    changed = page.eval_on_selector_all(
        "#patch-grid thead tr:nth-child(2) .changed", "ts => ts.map(t => t.textContent)"
    )
    assert changed == ["No"]  # the corrupted token, under the clean one it replaced
    # the embedding's row: patching the one changed position restores it all, the rest nothing
    embedding = [float(cell) for cell in cells[:length]]
    assert embedding[1] == 1.0 and all(value == 0.0 for i, value in enumerate(embedding) if i != 1)
    # The link reproduces the grid; the target picker lists clean's next tokens.
    page.wait_for_function("document.querySelector('#patch-target').options.length > 2")
    target = page.eval_on_selector("#patch-target", "s => s.options[2].value")
    page.select_option("#patch-target", target)
    page.wait_for_function(f"location.search.includes('target={target}')")
    again = page.url
    grid = page.inner_text("#patch-grid")
    page.goto("about:blank")
    open_patch(page, "", again)
    assert page.input_value("#clean") == PROMPT and page.input_value("#corrupted") == CORRUPTED
    assert page.input_value("#patch-target") == target
    assert page.inner_text("#patch-grid") == grid


def test_patch_shows_the_servers_400_when_the_lengths_differ(watched: Watched) -> None:
    page = watched.open()
    query = "?" + str(httpx.QueryParams({"view": "patch", "model": "alibi", "clean": PROMPT}))
    open_patch(page, watched.url, query)
    set_value(page, "#corrupted", PROMPT + " again")
    page.click("#patch-run")
    page.wait_for_selector("#patch-readout.error")
    message = page.inner_text("#patch-readout")
    assert "corrupted" in message and "tokens" in message, message
    assert page.locator("#patch-grid table").count() == 0
    assert "not" in page.inner_text("#corrupted-count")  # the counts beside the prompts differ
    watched.errors[:] = [e for e in watched.errors if "status of 400" not in e]


def test_the_length_view_draws_a_curve_per_model_up_to_what_each_serves(
    watched: Watched, playground: Running
) -> None:
    models = {
        entry["id"]: entry for entry in httpx.get(f"{playground.url}/v1/models").json()["data"]
    }
    page = watched.open()
    page.goto(watched.url + "?view=length&models=rope,alibi,learned&smoothing=4")
    page.wait_for_selector("body[data-ready=true]")
    page.wait_for_selector("#length-chart svg", timeout=60_000)
    chart = "#length-chart"
    assert sorted((page.get_attribute(chart, "data-models") or "").split(",")) == [
        "alibi",
        "learned",
        "rope",
    ]
    assert page.get_attribute(chart, "data-trained") == str(CONTEXT_LENGTH)
    assert f"trained length {CONTEXT_LENGTH}" in page.inner_text(chart)
    paths = page.eval_on_selector_all(
        "#length-chart g[aria-label=line] path",
        "ps => ps.map(p => p.getAttribute('d').split(/[ML]/).filter(Boolean).length)",
    )
    # the long passage is past every tiny model: each line ends at what its model serves
    served = sorted(models[name]["max_context"] - 1 for name in ("rope", "alibi", "learned"))
    assert sorted(paths) == served
    assert page.locator("#length-table tbody tr").count() == 3
    assert f"the first {models['learned']['max_context']} of" in page.inner_text("#length-cut")
    # The smoothing redraws without asking the server again; the URL keeps it and the boxes.
    asked = len([r for r in watched.requests if r.url.endswith("/v1/completions")])
    before = drawn(page, chart)
    set_value(page, "#smoothing", 1)
    page.wait_for_function(f"+document.querySelector('{chart}').dataset.drawn > {before}")
    assert len([r for r in watched.requests if r.url.endswith("/v1/completions")]) == asked
    params = parse_qs(urlsplit(page.url).query)
    assert params["smoothing"] == ["1"] and sorted(params["models"][0].split(",")) == [
        "alibi",
        "learned",
        "rope",
    ]
    page.uncheck("#length-models input[value=alibi]")
    models_drawn = (
        f"(document.querySelector('{chart}').dataset.models ?? '').split(',').sort() + ''"
    )
    two = f"{models_drawn} === 'learned,rope'"
    page.wait_for_function(two)
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    page.wait_for_function(two, timeout=60_000)
    assert page.input_value("#smoothing") == "1"
