"""Structured outputs as an attacker sends them, beside streams on the same model: a 20-byte
grammar bomb, six costly grammars, a JSON schema whose $refs loop, and a grammar that fails in
the engine after it was accepted. Each is refused with a 400 naming its field, or ends with an
error of its own; the streams beside it finish whole, at their pace (``model.grammar``'s limits
and budgets; the engine queues a constrained job only once its grammar has compiled)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest

from tests.server.conftest import Running, sse_events
from tests.server.test_fair_share import STREAM, stream_gaps

T = TypeVar("T")

BOMB = "((a{100}){100}){100}"  # 20 bytes: its lexer needs a million states
LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
STREAMS, TOKENS = 4, 100


def beside_streams(url: str, attack: Callable[[], T]) -> tuple[np.ndarray, T]:
    """Run ``attack`` once STREAMS streams of TOKENS tokens each are under way; return every
    gap between their chunks (the first: the wait for the first chunk) and what ``attack``
    returned. Each stream must finish whole, without an error event."""
    started = threading.Barrier(STREAMS + 1)
    results: list[tuple[list[float], int] | None] = [None] * STREAMS

    def run(index: int) -> None:
        body = {**STREAM, "seed": index, "max_tokens": TOKENS}
        results[index] = stream_gaps(url, body, started)

    streams = [threading.Thread(target=run, args=(i,)) for i in range(STREAMS)]
    for thread in streams:
        thread.start()
    started.wait()
    time.sleep(0.1)  # the streams are decoding
    outcome = attack()
    for thread in streams:
        thread.join(60)
    assert all(result is not None for result in results), "a stream failed (see its thread)"
    assert [tokens for _, tokens in results] == [TOKENS] * STREAMS  # type: ignore[misc]
    return np.array([gap for gaps, _ in results for gap in gaps]), outcome  # type: ignore[misc]


def complete(url: str, regex: str, **body: Any) -> httpx.Response:
    body = {"model": "rope", "prompt": "To be", "max_tokens": 60, "seed": 1, **body}
    body["structured_outputs"] = {"regex": regex}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def refused(answer: httpx.Response, field: str = "structured_outputs.regex") -> str:
    """The message of a 400 that names ``field``."""
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["message"].startswith(f"{field}: ") and error["param"] == field.split(".")[0]
    return str(error["message"])


def test_a_grammar_bomb_beside_four_streams_is_a_400_and_they_keep_their_pace(
    server: Running,
) -> None:
    """Before: the bomb passed the API's check in 1 ms; the engine's matcher spent ~3 s, then
    failed outside the per-row error handling, and the four streams ended with "the model
    failed on this batch"."""
    gaps, answer = beside_streams(server.url, lambda: complete(server.url, BOMB))
    assert "too many expressions constructed" in refused(answer)
    assert gaps.max() < 1.0, f"a gap of {gaps.max():.2f} s"


COSTLY = [f"((a{{80}}){{80}}){{{k}}}" for k in (6, 8, 40, 44, 48, 52)]


def test_six_costly_grammars_leave_the_streams_a_p99_gap_within_200_ms(server: Running) -> None:
    """Six grammars whose masks cost milliseconds a token (5–7 ms for the first two, 35–50 ms
    for the others without the limits), sent together beside the streams: the check refuses
    the heavy ones (their lexer runs out of fuel at the first token), the others decode within
    their budget, or end with an error of their own if a mask passes it. Before, each costly
    row's mask ran on the engine loop at every step, and compiling stalled it too."""

    def costly() -> list[httpx.Response]:
        with ThreadPoolExecutor(len(COSTLY)) as pool:
            return list(pool.map(lambda regex: complete(server.url, regex), COSTLY))

    gaps, answers = beside_streams(server.url, costly)
    for regex, answer in zip(COSTLY, answers, strict=True):
        if regex in COSTLY[2:]:
            assert "too many expressions constructed" in refused(answer), regex
        elif answer.status_code == 200:
            text = answer.json()["choices"][0]["text"]
            assert set(text) == {"a"}, text
        else:  # a mask that passed its budget on a busy host: its own error, from the engine
            # (grammar_failed) or from the check before it was accepted (a 400 naming the field)
            error = answer.json()["error"]
            assert answer.status_code == 400, answer.text
            assert error["code"] == "grammar_failed" or (
                error["param"] == "structured_outputs" and "token mask took" in error["message"]
            ), answer.text
    p99 = np.percentile(gaps, 99)
    assert p99 <= 0.200, f"p99 gap {p99 * 1e3:.0f} ms"


def test_a_grammar_that_fails_in_the_engine_ends_its_own_request_alone(server: Running) -> None:
    """The engine's mask budget set below what the API checked it with: the grammar is
    accepted, then its first mask in the engine passes the budget. Its request ends with a 400
    that says so (streamed: as its last event); the streams beside it never notice."""
    regex = "((a{80}){80}){3}"  # ~3 ms of CPU a mask: within the API's 10 ms, past 1 ms

    def failing() -> tuple[httpx.Response, list[Any]]:
        plain = complete(server.url, regex)
        body = {"model": "rope", "prompt": "To be", "max_tokens": 60, "stream": True}
        body["structured_outputs"] = {"regex": regex}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            events = list(sse_events(r.iter_lines()))
        return plain, events

    replaced = server.control.call("mask_budget", 0.001)
    try:
        gaps, (plain, events) = beside_streams(server.url, failing)
    finally:
        server.control.call("mask_budget", replaced)
    assert plain.status_code == 400, plain.text
    error = plain.json()["error"]
    assert error["code"] == "grammar_failed" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("structured output failed for this request: its token")
    assert "ms of CPU to compute; at most 1 ms a token are allowed" in error["message"]
    streamed = [event for event in events if isinstance(event, dict) and "error" in event]
    assert [event["error"]["code"] for event in streamed] == ["grammar_failed"]
    assert gaps.max() < 1.0, f"a gap of {gaps.max():.2f} s"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"prompt": "To be", "structured_outputs": {"json": LOOP}}, None),
        ("/v1/trace", {"prompt": "To be", "structured_outputs": {"json": LOOP}}, None),
        ("/v1/trace", {"prompt": "To be", "guided_json": LOOP}, "guided_json"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Whither?"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "loop", "schema": LOOP},
                },
            },
            "response_format.json_schema.schema",
        ),
    ],
)
def test_a_json_schema_whose_refs_loop_is_a_400_naming_the_field(
    server: Running, path: str, body: dict[str, Any], field: str | None
) -> None:
    """Before: it passed llguidance's validation, then its first mask failed in the engine:
    a 500 on completions and on /v1/trace."""
    answer = httpx.post(f"{server.url}{path}", json={**body, "model": "rope"}, timeout=30)
    message = refused(answer, field or "structured_outputs.json")
    assert "no output can match it" in message
