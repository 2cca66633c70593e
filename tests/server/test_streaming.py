"""Streaming over real HTTP: events leave as tokens are made, many streams share one batch
without changing their results, a client that leaves frees its row, and no chunk ever carries
a broken UTF-8 character or part of a stop string."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from model.kernels import decode_step
from model.tokenizer import load_tokenizer, token_bytes
from tests.server.conftest import (
    TEXT,
    Gate,
    Running,
    running_server,
    sse_events,
    test_settings,
    wait_for,
)


def complete(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def chunks_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(chunk["choices"][0]["text"] for chunk in chunks)


async def stream_async(client: httpx.AsyncClient, body: dict[str, Any], into: list) -> None:
    """Append each chunk of a streamed completion to ``into`` as it arrives."""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                into.append(orjson.loads(line.removeprefix("data: ")))
            elif line == "data: [DONE]":
                return
    raise AssertionError("the stream ended without [DONE]")


def gauge(text: str, name: str, model: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("model_name") == model:
                return sample.value
    raise KeyError(name)


def test_each_event_leaves_as_soon_as_its_step_is_done(client: httpx.Client, gate: Any) -> None:
    body = {"model": "none", "prompt": "To be, or", "max_tokens": 8, "seed": 3}
    held: Gate = gate("none")
    chunks = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response.iter_lines())
        while True:
            held.allow(1)  # exactly one more forward pass
            chunks.append(next(events))
            # The model is blocked before its next forward: this event left mid-generation.
            assert held.passed == len(chunks)
            if chunks[-1]["choices"][0]["finish_reason"] is not None:
                break
        assert next(events) == "[DONE]"
    held.open()
    assert len(chunks) >= 3

    whole = complete(client, **body)
    assert chunks_text(chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert whole["usage"]["completion_tokens"] == len(chunks)


def concurrent_bodies(count: int) -> list[dict[str, Any]]:
    """Requests of different lengths and sampling settings, so rows join and leave unevenly."""
    bodies = []
    for index in range(count):
        body = {
            "model": "rope",
            "prompt": TEXT[index % len(TEXT)][index : index + 4 + 2 * index],
            "max_tokens": 3 + (7 * index) % 20,
            "seed": index,
            "temperature": [1.0, 0.7, 0.0, 1.3][index % 4],
            "top_k": [0, 40][index % 2],
            "repetition_penalty": 1.3 if index % 5 == 0 else 1.0,
            "return_tokens_as_token_ids": True,
        }
        if index % 3:
            body["logprobs"] = index % 3
        bodies.append(body)
    return bodies


async def all_at_once(server: Running, bodies: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Every body streamed at once; each stream's chunks."""
    results: list[list[dict[str, Any]]] = [[] for _ in bodies]
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as async_client:
        await asyncio.gather(
            *(stream_async(async_client, b, r) for b, r in zip(bodies, results, strict=True))
        )
    return results


def test_concurrent_streams_equal_their_solo_results(server: Running, client: httpx.Client) -> None:
    bodies = concurrent_bodies(16)  # twice the batch size: half of them wait in the queue
    alone = [complete(client, **body)["choices"][0] for body in bodies]
    together = asyncio.run(all_at_once(server, bodies))
    for body, solo, chunks in zip(bodies, alone, together, strict=True):
        assert chunks_text(chunks) == solo["text"], body
        assert chunks[-1]["choices"][0]["finish_reason"] == solo["finish_reason"]
        if "logprobs" in body:
            tokens = [token for c in chunks for token in c["choices"][0]["logprobs"]["tokens"]]
            values = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
            assert tokens == solo["logprobs"]["tokens"]
            assert values == pytest.approx(solo["logprobs"]["token_logprobs"], abs=1e-4)


@pytest.mark.skipif(not decode_step.ready(), reason="the decode-step kernel needs AVX-512")
def test_streams_whose_steps_share_their_attention_equal_their_solo_results(
    server: Running, client: httpx.Client
) -> None:
    """The server's steps of eight rows share their attention with the kernel's helper thread
    (``--attention-helper``, on by default); here the helper takes every block's first row and
    the decode thread waits for it, so its results are in every step's logits for sure."""
    # all eight decoding together for most of their tokens, however their arrivals spread
    bodies = [{**body, "max_tokens": 64, "ignore_eos": True} for body in concurrent_bodies(8)]
    alone = [complete(client, **body)["choices"][0] for body in bodies]
    before = server.control.call("shared_rows")
    shared = server.control.call("shares_large_steps")  # as the settings left it
    server.control.call("share_attention", True, "helper_finishes")
    try:
        together = asyncio.run(all_at_once(server, bodies))
    finally:
        server.control.call("share_attention", shared, "free")
    assert server.control.call("shared_rows")[0] > before[0]  # rows the helper attended
    for body, solo, chunks in zip(bodies, alone, together, strict=True):
        assert chunks_text(chunks) == solo["text"], body


def test_a_client_that_leaves_frees_its_row_within_one_step(
    server: Running, client: httpx.Client, gate: Any
) -> None:
    model = "sinusoidal"
    bodies = [{"model": model, "prompt": TEXT[i], "max_tokens": 30, "seed": i} for i in range(3)]
    alone = [complete(client, **body)["choices"][0]["text"] for body in bodies[1:]]
    engine = server.engine(model)
    held: Gate = gate(model)

    async def scenario() -> list[list[dict[str, Any]]]:
        received: list[list[dict[str, Any]]] = [[], [], []]
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as async_client:

            async def metric(name: str) -> float:
                return gauge((await async_client.get("/metrics")).text, name, model)

            readers = [
                asyncio.create_task(stream_async(async_client, body, into))
                for body, into in zip(bodies, received, strict=True)
            ]
            while not (all(received) and held.settled):  # until all three have a token
                if held.settled:
                    held.allow(1)
                await asyncio.sleep(0.01)
            assert await metric("ordinal_num_requests_running") == 3

            readers[0].cancel()  # the first client hangs up mid-stream
            await asyncio.gather(readers[0], return_exceptions=True)
            await asyncio.to_thread(wait_for, lambda: engine.closing > 0, "the cancel")
            steps = held.passed
            held.allow(1)  # the step running now ends; the next one starts without the row
            while await metric("ordinal_num_requests_running") != 2:
                await asyncio.sleep(0.01)
            assert held.passed == steps + 1
            assert await metric("ordinal_num_requests_waiting") == 0

            held.open()
            await asyncio.gather(*readers[1:])
        return received

    received = asyncio.run(scenario())
    assert [chunks_text(chunks) for chunks in received[1:]] == alone  # the others: unaffected
    assert engine.in_flight == 0
    metrics = client.get("/metrics").text
    assert gauge(metrics, "ordinal_num_requests_running", model) == 0


def test_a_non_stream_client_that_leaves_frees_its_row(
    server: Running, client: httpx.Client, gate: Any
) -> None:
    model = "integer"
    engine = server.engine(model)
    before = gauge(client.get("/metrics").text, "ordinal_generation_tokens_total", model)
    held: Gate = gate(model)
    body = {"model": model, "prompt": "a", "max_tokens": 50}
    with (
        httpx.Client(base_url=server.url, timeout=0.3) as impatient,
        pytest.raises(httpx.ReadTimeout),
    ):
        impatient.post("/v1/completions", json=body)
    wait_for(lambda: engine.closing > 0, "the server to notice the client left")
    held.open()
    wait_for(lambda: engine.in_flight == 0, "the row to be freed")
    after = gauge(client.get("/metrics").text, "ordinal_generation_tokens_total", model)
    assert after - before == 1  # the step that was running; none after it


MULTIBYTE_PROMPT = "🎭 Ça va, naïve café? 你好 — ¿sí? 🤖"


@pytest.mark.parametrize("seed", range(3))
def test_multibyte_text_streams_as_whole_characters(
    client: httpx.Client, checkpoints: Path, seed: int
) -> None:
    table = token_bytes(load_tokenizer(checkpoints / "t5" / "tokenizer.json"))
    body = {
        "model": "t5",
        "prompt": MULTIBYTE_PROMPT,
        "max_tokens": 40,
        "seed": seed,
        "echo": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        raw = response.read()
    events = [event for event in raw.split(b"\n\n") if event]
    assert events[-1] == b"data: [DONE]"
    # Every event is strict UTF-8 and valid JSON on its own.
    chunks = [orjson.loads(event.removeprefix(b"data: ").decode("utf-8")) for event in events[:-1]]
    texts = [chunk["choices"][0]["text"] for chunk in chunks]
    assert texts[0] == MULTIBYTE_PROMPT  # the echo

    ids = [
        int(token.removeprefix("token_id:"))
        for chunk in chunks[1:]
        for token in chunk["choices"][0]["logprobs"]["tokens"]
    ]
    # A character split between two chunks would show up as two U+FFFD instead of one character.
    assert "".join(texts[1:]) == b"".join(table[i] for i in ids).decode("utf-8", errors="replace")
    assert "".join(texts) == complete(client, **body)["choices"][0]["text"]


@pytest.mark.parametrize("seed", range(3))
def test_a_stop_string_across_tokens_is_never_emitted(client: httpx.Client, seed: int) -> None:
    body = {"model": "alibi", "prompt": TEXT[1], "max_tokens": 30, "seed": seed}
    free = complete(client, **body, logprobs=0)["choices"][0]
    text, offsets = free["text"], free["logprobs"]["text_offset"]
    # Three characters around a boundary between two tokens, well inside the text.
    boundary = next(o for o in offsets if 4 <= o <= len(text) - 2)
    stop = text[boundary - 1 : boundary + 2]
    expected = text[: text.index(stop)]

    stopped = complete(client, **body, stop=[stop, "never appears §"])["choices"][0]
    assert (stopped["text"], stopped["finish_reason"]) == (expected, "stop")
    with client.stream("POST", "/v1/completions", json={**body, "stop": stop, "stream": True}) as r:
        chunks = [event for event in sse_events(r.iter_lines()) if event != "[DONE]"]
    assert chunks_text(chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_ignore_eos_generates_past_eos_the_same_tokens(client: httpx.Client) -> None:
    # Hot sampling makes the tiny model end on <|eos|> early for some seed; with ignore_eos the
    # same seeded request draws the same tokens up to there and keeps going to max_tokens.
    body = {"prompt": "To be", "max_tokens": 40, "temperature": 2.0, "logprobs": 0}
    for seed in range(50):
        ended = complete(client, **body, seed=seed)
        if ended["choices"][0]["finish_reason"] == "stop":
            break
    else:
        pytest.fail("no seed ended on <|eos|>")
    kept = complete(client, **body, seed=seed, ignore_eos=True)
    generated = ended["usage"]["completion_tokens"]
    assert generated < 40
    assert kept["usage"]["completion_tokens"] == 40
    assert kept["choices"][0]["finish_reason"] == "length"
    before, after = ended["choices"][0]["logprobs"], kept["choices"][0]["logprobs"]
    assert after["tokens"][:generated] == before["tokens"]  # EOS included, then more


def test_a_stream_interval_never_delays_the_end_of_a_stream(checkpoints: Path) -> None:
    # An interval far longer than the whole completion: the middle tokens wait for the last one,
    # and the request still ends as soon as its last token is made, with every token in order:
    # the middle ones in one event with the last (the first leaves at once, in an event of its
    # own unless the API process reads it only once the rest has come).
    body = {"model": "rope", "prompt": "To be", "max_tokens": 24, "ignore_eos": True, "seed": 5}
    settings = test_settings(checkpoints, models=["rope"], stream_interval=60.0)
    with running_server(settings) as running, httpx.Client(base_url=running.url) as client:
        whole = complete(client, **body)
        start = time.perf_counter()
        chunks: list[Any] = []
        asyncio.run(_stream_with(running.url, body, chunks))
        elapsed = time.perf_counter() - start
    assert elapsed < 30  # nowhere near the 60 s interval
    assert len(chunks) <= 2
    assert chunks_text(chunks) == whole["choices"][0]["text"]


async def _stream_with(url: str, body: dict[str, Any], into: list) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        await stream_async(client, body, into)
