"""Every bad input gets its status and an OpenAI-shaped error naming the field; none of them
reaches an engine, so none can kill a worker or hold a row."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import (
    CONTEXT_LENGTH,
    MAX_POSITIONS,
    Running,
    running_server,
    sse_events,
    test_settings,
    wait_for,
)

OK = {"prompt": "To be"}
BAD_BODIES: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("temperature above 2", {**OK, "temperature": 2.5}, 400, "temperature"),
    ("temperature below 0", {**OK, "temperature": -0.1}, 400, "temperature"),
    ("temperature as a string", {**OK, "temperature": "hot"}, 400, "temperature"),
    ("temperature as a boolean", {**OK, "temperature": True}, 400, "temperature"),
    ("top_p of 0", {**OK, "top_p": 0}, 400, "top_p"),
    ("top_p above 1", {**OK, "top_p": 1.01}, 400, "top_p"),
    ("negative top_k", {**OK, "top_k": -1}, 400, "top_k"),
    ("fractional top_k", {**OK, "top_k": 2.5}, 400, "top_k"),
    ("min_p above 1", {**OK, "min_p": 1.5}, 400, "min_p"),
    ("repetition_penalty of 0", {**OK, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("max_tokens 0 without echo", {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("negative max_tokens", {**OK, "max_tokens": -3}, 400, "max_tokens"),
    ("max_tokens past the context", {**OK, "max_tokens": 10**6}, 400, "max_tokens"),
    ("logprobs above 20", {**OK, "logprobs": 21}, 400, "logprobs"),
    ("negative logprobs", {**OK, "logprobs": -1}, 400, "logprobs"),
    ("five stop strings", {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("an empty stop string", {**OK, "stop": ["a", ""]}, 400, "stop"),
    ("stop as a number", {**OK, "stop": 3}, 400, "stop"),
    ("negative seed", {**OK, "seed": -1}, 400, "seed"),
    ("fractional seed", {**OK, "seed": 1.5}, 400, "seed"),
    ("seed past 64 bits", {**OK, "seed": 2**64}, 400, "seed"),
    ("prompt as a number", {"prompt": 42}, 400, "prompt"),
    ("prompt list with a string", {"prompt": [1, "a"]}, 400, "prompt"),
    ("negative token id", {"prompt": [1, -2]}, 400, "prompt"),
    ("ignore_eos as a string", {**OK, "ignore_eos": "yes"}, 400, "ignore_eos"),
    ("token id past the vocabulary", {"prompt": [0, 10**6]}, 400, "prompt"),
    ("no prompt", {"max_tokens": 3}, 400, "prompt"),
    ("stream as a string", {**OK, "stream": "yes"}, 400, "stream"),
    ("echo as a number", {**OK, "echo": 1}, 400, "echo"),
    ("an unknown field", {**OK, "best_of": 2}, 400, "best_of"),
    ("n above 8", {**OK, "n": 9}, 400, "n"),
    ("n of 0", {**OK, "n": 0}, 400, "n"),
    ("more than 16 choices", {"prompt": ["a", "b", "c"], "n": 6}, 400, "n"),
    ("stream_options not an object", {**OK, "stream_options": True}, 400, "stream_options"),
    ("prompt past a table's positions", {"model": "learned", "prompt": [0] * 64}, 400, "prompt"),
    ("prompt past rope's context", {"model": "rope", "prompt": [0] * 4 * 32}, 400, "prompt"),
    ("an unknown model", {**OK, "model": "gpt-4"}, 404, "model"),
]


def assert_error(response: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    if param is not None:
        assert param in error["message"] or status == 404
    return error


@pytest.mark.parametrize(
    ("body", "status", "param"), [case[1:] for case in BAD_BODIES], ids=[c[0] for c in BAD_BODIES]
)
def test_bad_completion_requests(
    client: httpx.Client, body: dict[str, Any], status: int, param: str
) -> None:
    variants = [body] if "stream" in body else [body, {**body, "stream": True}]
    for variant in variants:  # a stream is refused before it starts, with the same error
        assert_error(client.post("/v1/completions", json=variant), status, param)


def test_a_prompt_too_long_names_both_numbers(client: httpx.Client) -> None:
    message = assert_error(
        client.post("/v1/completions", json={"model": "mds", "prompt": [0] * MAX_POSITIONS}),
        400,
        "prompt",
    )["message"]
    assert f"{MAX_POSITIONS} tokens long" in message and f"at most {MAX_POSITIONS - 1}" in message
    # Scoring needs no room for a new token: the whole table is usable.
    scored = {"model": "mds", "prompt": [0] * MAX_POSITIONS, "max_tokens": 0, "echo": True}
    assert client.post("/v1/completions", json={**scored, "logprobs": 1}).status_code == 200
    too_many = {"model": "rope", "prompt": "To be", "max_tokens": 4 * CONTEXT_LENGTH}
    message = assert_error(client.post("/v1/completions", json=too_many), 400, "max_tokens")[
        "message"
    ]
    assert str(4 * CONTEXT_LENGTH) in message and str(4 * CONTEXT_LENGTH - 3) in message


@pytest.mark.parametrize(
    "content", [b"{not json", b"[1, 2]", b"", b'"a prompt"', b'{"prompt": "caf\xe9"}']
)
def test_a_body_that_is_not_a_json_object_is_400(client: httpx.Client, content: bytes) -> None:
    headers = {"content-type": "application/json"}
    response = client.post("/v1/completions", content=content, headers=headers)
    assert_error(response, 400, None)


def test_bad_input_leaves_every_engine_empty_and_working(
    server: Running, client: httpx.Client
) -> None:
    for name in server.service.models:
        assert server.engine(name).in_flight == 0
    assert client.post("/v1/completions", json={**OK, "max_tokens": 2}).status_code == 200


def test_tokenize_rejects_what_completions_reject(client: httpx.Client) -> None:
    assert_error(client.post("/v1/tokenize", json={"prompt": 3}), 400, "prompt")
    assert_error(client.post("/v1/tokenize", json={"prompt": "a", "model": "x"}), 404, "model")


def test_unknown_route_is_404_in_openai_shape(client: httpx.Client) -> None:
    assert_error(client.get("/v1/nothing"), 404, None)


# ---- a server with an API key, one row, a queue of one and a small body limit ---------------

KEY = "sesame"
ORIGIN = "http://example.org"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def small_server(checkpoints: Path) -> Iterator[Running]:
    settings = test_settings(
        checkpoints, models=["rope"], max_batch_size=1, max_queue=1, api_key=KEY,
        max_body_bytes=2000, cors_origins=[ORIGIN],
    )  # fmt: skip
    with running_server(settings) as running:
        yield running


@pytest.fixture
def small_client(small_server: Running) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=small_server.url, timeout=30, headers=AUTH) as client:
        yield client


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}])
def test_api_key_is_required_on_v1(small_server: Running, headers: dict[str, str]) -> None:
    with httpx.Client(base_url=small_server.url, timeout=30, headers=headers) as client:
        for response in (
            client.get("/v1/models"),
            client.post("/v1/completions", json=OK),
            client.post("/v1/completions", content=b"{not json"),  # 401 before the body
        ):
            assert_error(response, 401, None)
            assert response.headers["www-authenticate"] == "Bearer"
        assert client.get("/health").status_code == 200  # probes need no key
        assert client.get("/metrics").status_code == 200


def test_auth_scope_all_protects_metrics_and_docs_too(checkpoints: Path) -> None:
    settings = test_settings(checkpoints, models=["rope"], api_key=KEY, auth_scope="all")
    with running_server(settings) as running, httpx.Client(base_url=running.url) as client:
        for path in ("/metrics", "/docs", "/openapi.json", "/v1/models"):
            assert_error(client.get(path), 401, None)
            assert client.get(path, headers=AUTH).status_code == 200
        assert client.get("/health").status_code == 200  # probes need no key


def test_auth_scope_all_serves_a_playground_that_asks_for_the_key(checkpoints: Path) -> None:
    settings = test_settings(checkpoints, models=["rope"], api_key=KEY, auth_scope="all")
    with running_server(settings) as running, httpx.Client(base_url=running.url) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "<script" in page.text and "/static/app.js" in page.text
        assert client.get("/static/app.js").status_code == 200
        script = client.get("/static/api.js")  # the module that talks to the server
        assert script.status_code == 200
        # On a 401 the page asks for the key, keeps it for the tab and sends it on every call.
        assert "window.prompt(" in script.text and "Authorization: `Bearer ${key}`" in script.text
        assert_error(client.get("/v1/models"), 401, None)  # what the page reads still needs it
        assert client.get("/v1/models", headers=AUTH).status_code == 200
        assert_error(client.get("/static/../metrics"), 401, None)


def test_the_right_key_is_accepted(small_client: httpx.Client) -> None:
    assert small_client.get("/v1/models").status_code == 200
    response = small_client.post("/v1/completions", json={**OK, "max_tokens": 2})
    assert response.status_code == 200


def test_an_oversize_body_is_413(small_client: httpx.Client) -> None:
    big = {"prompt": "x" * 3000}
    assert_error(small_client.post("/v1/completions", json=big), 413, None)

    def chunks() -> Iterator[bytes]:  # no Content-Length: caught while the body streams in
        yield b'{"prompt": "'
        yield b"x" * 3000
        yield b'"}'

    response = small_client.post(
        "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert_error(response, 413, None)
    assert small_client.post("/v1/completions", json={**OK, "max_tokens": 1}).status_code == 200


def test_a_full_queue_is_429_with_retry_after(small_server: Running) -> None:
    engine = small_server.engine("rope")
    held = small_server.gate("rope")
    body = {**OK, "max_tokens": 20, "seed": 1}

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=small_server.url, timeout=60, headers=AUTH) as c:
            running = asyncio.create_task(c.post("/v1/completions", json=body))  # takes the row
            waiting = asyncio.create_task(c.post("/v1/completions", json=body))  # the queue
            while engine.in_flight < 2:
                await asyncio.sleep(0.01)
            refused = await c.post("/v1/completions", json=body)
            error = assert_error(refused, 429, None)
            assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
            assert refused.headers["retry-after"] == "1"

            held.open()
            first, second = await asyncio.gather(running, waiting)
            assert first.status_code == second.status_code == 200
            assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]

    try:
        asyncio.run(scenario())
    finally:
        held.open()
    assert engine.in_flight == 0


def test_cors_preflight_needs_no_key(small_server: Running) -> None:
    headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    with httpx.Client(base_url=small_server.url, timeout=30) as client:
        allowed = client.options("/v1/completions", headers=headers)
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == ORIGIN
        refused = client.options("/v1/completions", headers={**headers, "Origin": "http://x.y"})
        assert refused.status_code == 400


def test_a_request_past_the_timeout_is_504_and_frees_its_row(
    small_server: Running, small_client: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = small_server.engine("rope")
    monkeypatch.setattr(small_server.service.settings, "request_timeout", 0.2)
    held = small_server.gate("rope")  # the model never gets to run
    try:
        body = {**OK, "max_tokens": 5}
        assert_error(small_client.post("/v1/completions", json=body), 504, None)
        with small_client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            events = list(sse_events(r.iter_lines()))
        assert r.status_code == 200  # the headers went out before the deadline
        assert events[-1] == "[DONE]"
        assert "timeout" in events[-2]["error"]["message"]
    finally:
        held.open()
    wait_for(lambda: engine.in_flight == 0, "the expired jobs to leave")


def test_a_failing_step_fails_its_requests_not_the_engine(
    server: Running, client: httpx.Client
) -> None:
    body = {"model": "lowrank", "prompt": "a", "max_tokens": 3}
    registry = server.service.metrics.registry
    labels = {"model_name": "lowrank", "reason": "model_error"}
    before = registry.get_sample_value("ordinal_request_failures_total", labels)
    server.control.call("break_model", "lowrank")  # in the engine process
    try:
        error = assert_error(client.post("/v1/completions", json=body), 500, None)
        assert error["type"] == "server_error" and "the model failed" in error["message"]
    finally:
        server.control.call("reset", "lowrank")
    assert client.post("/v1/completions", json=body).status_code == 200
    assert server.engine("lowrank").in_flight == 0
    assert registry.get_sample_value("ordinal_request_failures_total", labels) == before + 1
