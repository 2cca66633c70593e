"""The playground in a real headless Chromium: it loads cleanly and offline, streams a
generation, compares models in columns, draws attention heatmaps and sampling-stage bars, and
draws each scheme's encoding beside its measured geometry report."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx

from tests.browser.conftest import Watched
from tests.browser.pages import drawn, open_encodings, open_inside, set_value
from tests.server.conftest import Running, running_server, test_settings

PROMPT = "To be, or not to be, that is the question"

BARS = "#stages-chart svg g[aria-label=bar] rect"
ATTENTION = "#attention-chart canvas"  # drawn to canvas: one pixel block per (query, key)
PIXELS = "c => c.toDataURL()"


def test_the_page_loads_clean_and_offline(watched: Watched, playground: Running) -> None:
    page = watched.open()
    assert page.title() == "ordinal playground"
    options = page.eval_on_selector_all("#model option", "os => os.map(o => o.value)")
    assert sorted(options) == sorted(playground.service.models)
    for view in ("compare", "inside", "generate"):
        page.click(f"button[data-view={view}]")
        page.wait_for_selector(f"#view-{view}:not([hidden])")
    page.wait_for_selector(ATTENTION, state="attached")  # the Inside view traced the prompt
    assert watched.requests, "the page made no request at all"
    hosts = {request.url.split("/")[2] for request in watched.requests}
    assert hosts == {playground.url.removeprefix("http://")}


def test_a_generation_streams_tokens_into_the_page(watched: Watched, playground: Running) -> None:
    page = watched.open()
    page.select_option("#model", "rope")
    set_value(page, "#prompt", PROMPT)
    set_value(page, "#max_tokens", 24)
    set_value(page, "#seed", 7)
    page.click("#generate")
    page.wait_for_selector("#generate:not([disabled])")
    tokens = page.eval_on_selector_all("#output .tok", "ts => ts.map(t => t.textContent)")
    assert len(tokens) >= 1
    sent = [r for r in watched.requests if r.url.endswith("/v1/completions")]
    assert len(sent) == 1 and '"stream":true' in sent[0].post_data
    # The same request unstreamed gives the same text: the page showed the real tokens.
    settings = page.evaluate("JSON.parse(JSON.stringify(" + SETTINGS_JS + "))")
    ids = httpx.post(f"{playground.url}/v1/tokenize", json={"model": "rope", "prompt": PROMPT})
    body = {
        "model": "rope",
        "prompt": ids.json()["tokens"],
        "max_tokens": 24,
        "seed": 7,
        **settings,
    }
    expected = httpx.post(f"{playground.url}/v1/completions", json=body).json()
    assert "".join(tokens) == expected["choices"][0]["text"]
    # Clicking a token shows its alternatives before and after each sampling stage.
    page.click("#output .tok:not(:empty) >> nth=0")
    page.wait_for_selector("#alternatives svg g[aria-label=bar] rect")
    assert page.locator("#alternatives").inner_text().count("kept") >= 2


SETTINGS_JS = """({temperature: +temperature.value, top_k: +top_k.value, top_p: +top_p.value,
min_p: +min_p.value, repetition_penalty: +repetition_penalty.value})"""


def test_compare_with_three_models_shows_three_columns(watched: Watched) -> None:
    page = watched.open()
    page.click("button[data-view=compare]")
    checked = page.eval_on_selector_all(
        "#compare-models input:checked", "bs => bs.map(b => b.value)"
    )
    assert sorted(checked) == ["alibi", "none", "rope"]
    set_value(page, "#prompt", PROMPT)
    set_value(page, "#max_tokens", 20)
    page.click("#compare")
    page.wait_for_selector("#compare:not([disabled])")
    columns = page.locator("#columns .column")
    assert columns.count() == 3
    for index in range(3):
        column = columns.nth(index)
        generated = column.locator(".text-output > .tok")
        assert generated.count() >= 1, column.inner_text()
        assert column.locator(".prompt-text .tok").count() > 1  # the prompt, shaded


def test_compare_shows_a_table_schemes_400_as_a_message(watched: Watched) -> None:
    page = watched.open()
    page.click("button[data-view=compare]")
    page.click("#no-models")
    page.check("#compare-models input[value=learned]")
    page.check("#compare-models input[value=alibi]")
    # 92 tokens: past the tiny learned model's 64 positions, within alibi's 128-token context.
    set_value(page, "#prompt", " ".join([PROMPT] * 4))
    set_value(page, "#max_tokens", 20)
    page.click("#compare")
    page.wait_for_selector("#compare:not([disabled])")
    learned = page.locator(".column[data-model=learned] .error")
    assert "context holds 64 tokens" in learned.inner_text()
    assert page.locator(".column[data-model=alibi] .error").count() == 0
    # Chromium logs the 400 response itself as a console error; that one is expected.
    watched.errors[:] = [e for e in watched.errors if "status of 400" not in e]


def inside(page: Any, model: str = "alibi") -> int:
    """Open the Inside view on ``model`` and PROMPT; returns the trace's token count."""
    open_inside(page, model, PROMPT)
    page.wait_for_selector(ATTENTION, state="attached")
    return int(page.inner_text("#trace-stats").split()[0])


def test_inside_draws_the_attention_heatmap_and_redraws_per_head(watched: Watched) -> None:
    page = watched.open()
    length = inside(page)
    cells = int(page.get_attribute("#attention-chart", "data-cells") or 0)
    assert cells == length * (length + 1) // 2  # the causal T×T triangle
    assert int(page.get_attribute("#position-chart .bias", "data-cells") or 0) == cells
    fills = page.eval_on_selector(ATTENTION, PIXELS)
    before = drawn(page, "#attention-chart")
    page.select_option("#head", "1")
    page.wait_for_function(f"+document.querySelector('#attention-chart').dataset.drawn > {before}")
    assert page.get_attribute("#attention-chart", "data-head") == "1"
    assert page.locator("#heads .head-thumb").count() == 4  # every head of the layer, small
    again = page.eval_on_selector(ATTENTION, PIXELS)
    assert again != fills


def test_moving_the_temperature_slider_changes_the_bars(watched: Watched) -> None:
    page = watched.open()
    inside(page, "rope")
    page.wait_for_selector(BARS, state="attached")
    widths = page.eval_on_selector_all(BARS, "rs => rs.map(r => r.getAttribute('width'))")
    before = drawn(page, "#stages-chart")
    set_value(page, "#temperature", 1.9)
    page.wait_for_function(f"+document.querySelector('#stages-chart').dataset.drawn > {before}")
    after = page.eval_on_selector_all(BARS, "rs => rs.map(r => r.getAttribute('width'))")
    assert after != widths
    assert page.inner_text("output[for=temperature]") == "1.9"


def test_encodings_draws_a_scheme_and_redraws_for_another(watched: Watched) -> None:
    page = watched.open()
    open_encodings(page, "alibi")
    view = "#view-encodings"
    assert page.get_attribute(view, "data-scheme") == "alibi"
    # alibi: one bias heatmap per head, its bias against distance (a line per head).
    assert page.locator("#encoding-chart svg g[aria-label=raster] image").count() == 4
    assert page.locator("#distance-chart svg g[aria-label=line] path").count() == 4
    # The report: the chosen row highlighted in the requirement table (a row per shipped
    # checkpoint with an encoding per position, as the report has them), the six figures.
    origin = page.url.split("?")[0].rstrip("/")  # the page keeps its view in the query
    report = httpx.get(f"{origin}/v1/geometry/shakespeare").json()
    rows = page.locator("#requirements-table tbody tr")
    assert rows.count() == len(report["requirements"]) >= 12
    assert page.eval_on_selector_all(
        "#requirements-table tr.chosen", "rs => rs.map(r => r.dataset.scheme)"
    ) == ["alibi"]
    page.wait_for_function(
        "[...document.querySelectorAll('#figures img')].length === 6 && "
        "[...document.querySelectorAll('#figures img')].every(i => i.complete && i.naturalWidth)"
    )
    chosen = page.inner_text("#requirements-table tr.chosen")
    alibi = next(row for row in report["requirements"] if row["scheme"] == "alibi")
    assert f"({alibi['min_separation']:.3g})" in chosen  # the report's number, not a copy
    before = drawn(page, view)
    open_encodings(page, "learned")
    assert drawn(page, view) > before
    assert page.get_attribute(view, "data-scheme") == "learned"
    # learned: its vectors as one position × dimension heatmap, the dot product by distance.
    assert page.locator("#encoding-chart svg g[aria-label=raster] image").count() == 1
    assert page.locator("#distance-chart svg g[aria-label=line] path").count() == 1
    assert page.eval_on_selector_all(
        "#requirements-table tr.chosen", "rs => rs.map(r => r.dataset.scheme)"
    ) == ["learned"]
    open_encodings(page, "rope")
    assert page.locator("#encoding-chart svg g[aria-label=cell] rect").count() > 0  # angles
    # rope's own row, not prope's, though both are rope
    assert page.eval_on_selector_all(
        "#requirements-table tr.chosen", "rs => rs.map(r => r.cells[0].textContent)"
    ) == ["rope (rope)"]
    page.select_option("#corpus", "synthetic")
    page.wait_for_function(  # the synthetic report: every scheme untrained, 32 positions
        "document.querySelector('#report-what').textContent.startsWith('corpus synthetic')"
    )
    assert page.locator("#figures img[src*=synthetic]").count() == 6


def test_the_data_dependent_schemes_and_fire_draw_what_they_compute(watched: Watched) -> None:
    """fox: its forget gates and its layer bias against distance; cope: its contextual positions
    and their profile; fire: a bias per head. Inside: the chosen layer's bias beside attention."""
    page = watched.open()
    heads = 4  # the tiny checkpoints'
    open_encodings(page, "fox")
    assert page.locator("#encoding-chart svg g[aria-label=cell] rect").count() > 0  # gates
    assert page.locator("#distance-chart svg g[aria-label=line] path").count() == heads
    open_encodings(page, "cope")
    assert page.locator("#encoding-chart svg g[aria-label=cell] rect").count() > 0  # positions
    assert page.locator("#distance-chart svg g[aria-label=line] path").count() == heads
    open_encodings(page, "fire")
    assert page.locator("#encoding-chart svg g[aria-label=raster] image").count() == heads
    length = inside(page, "fox")
    cells = int(page.get_attribute("#position-chart .bias", "data-cells") or 0)
    assert cells == length * (length + 1) // 2  # the layer's causal bias, drawn to canvas
    assert "layer 0" in page.inner_text("#position-chart")


def test_a_server_with_an_api_key_asks_for_it_once(browser: Any, checkpoints: Any) -> None:
    """With ORDINAL_API_KEY set the page's /v1 calls get a 401: it asks for the key, then
    sends it on every call (the page itself and its assets need none)."""

    settings = test_settings(checkpoints, models=["rope"], api_key="sesame", stream_interval=0)
    with running_server(settings) as running:
        context = browser.new_context()
        page = context.new_page()
        asked: list[str] = []

        def answer(dialog: Any) -> None:
            asked.append(dialog.message)
            dialog.accept("sesame")

        page.on("dialog", answer)
        sent: list[str | None] = []
        page.on(
            "request",
            lambda r: "/v1/" in r.url and sent.append(r.headers.get("authorization")),
        )
        page.goto(running.url + "/")
        page.wait_for_selector("body[data-ready=true]")
        assert len(asked) == 1 and "API key" in asked[0]
        assert page.text_content("#status") == "1 models loaded"
        set_value(page, "#max_tokens", 4)
        page.click("#generate")
        page.wait_for_function(
            "document.querySelector('#generate-stats').textContent.includes('finished')"
        )
        assert sent[0] is None and set(sent[1:]) == {"Bearer sesame"}
        context.close()


def test_the_pickers_follow_checkpoints_loaded_while_serving(
    browser: Any, checkpoints: Path, tmp_path: Path
) -> None:
    """A checkpoint loaded while the page is open (here by ``POST /v1/models/reload``) appears
    in the model picker when it is next opened, and in Compare's boxes; the picked model and
    the ticked boxes stay; a removed one leaves both."""

    import httpx

    from tests.server.conftest import running_server, test_settings

    shutil.copytree(checkpoints / "rope", tmp_path / "rope")
    shutil.copytree(checkpoints / "alibi", tmp_path / "alibi")
    settings = test_settings(tmp_path, watch_interval=0, stream_interval=0)
    with running_server(settings) as running:
        context = browser.new_context()
        page = context.new_page()
        page.goto(running.url + "/")
        page.wait_for_selector("body[data-ready=true]")
        page.select_option("#model", "alibi")
        options = "[...document.querySelectorAll('#model option')].map((o) => o.value)"
        assert sorted(page.evaluate(options)) == ["alibi", "rope"]

        shutil.copytree(checkpoints / "learned", tmp_path / "learned")
        assert httpx.post(running.url + "/v1/models/reload", timeout=60).json()["loaded"] == [
            "learned"
        ]
        page.focus("#model")
        page.wait_for_function(f"{options}.includes('learned')")
        assert page.input_value("#model") == "alibi"
        ticked = "[...document.querySelectorAll('#compare-models input:checked')]"
        assert sorted(page.evaluate(f"{ticked}.map((box) => box.value)")) == ["alibi", "rope"]

        shutil.rmtree(tmp_path / "learned")
        httpx.post(running.url + "/v1/models/reload", timeout=60)
        page.focus("#status")
        page.focus("#model")
        page.wait_for_function(f"!{options}.includes('learned')")
        assert page.text_content("#status") == "2 models loaded"
        context.close()
