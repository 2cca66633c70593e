"""bench.http's load generator: each simulated client has its own connection pool, as separate
users do, and every one is closed when its level ends; Python's garbage collector does not run
while requests are timed.

The figures themselves are measurements (``make bench``); what is checked is how the load is
sent, against an in-memory server (httpx's MockTransport), nothing on the network.
"""

from __future__ import annotations

import asyncio
import gc
import json
from typing import Any, ClassVar

import httpx
import pytest

from bench import http as bench_http

EVENTS = (
    b"".join(
        b"data: " + json.dumps({"choices": [{"text": text}]}).encode() + b"\n\n"
        for text in ("a", "b", "c")
    )
    + b"data: [DONE]\n\n"
)


class RecordingClient(httpx.AsyncClient):
    """An AsyncClient answering every completion with three streamed tokens, which notes the
    requests it sent and whether it was closed."""

    made: ClassVar[list[RecordingClient]] = []
    collector_on: ClassVar[list[bool]] = []  # gc.isenabled() as each request was answered

    def __init__(self, **kwargs: Any) -> None:
        self.sent = 0
        self.finished = False

        def answer(request: httpx.Request) -> httpx.Response:
            self.sent += 1
            RecordingClient.collector_on.append(gc.isenabled())
            return httpx.Response(
                200, content=EVENTS, headers={"content-type": "text/event-stream"}
            )

        super().__init__(transport=httpx.MockTransport(answer), **kwargs)
        RecordingClient.made.append(self)

    async def aclose(self) -> None:
        self.finished = True
        await super().aclose()


class FailingClient(RecordingClient):
    """A RecordingClient whose every request gets a 500."""

    async def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        return httpx.Response(500, request=request)


def test_each_closed_loop_has_its_own_client_and_all_are_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    RecordingClient.made = []
    monkeypatch.setattr(bench_http.httpx, "AsyncClient", RecordingClient)
    done, wall = asyncio.run(
        bench_http.closed_loops("http://server", [1, 2, 3], 5, 3, min_seconds=0.0, min_rounds=4)
    )
    clients = RecordingClient.made
    assert len(clients) == 5  # one per simulated user, none shared
    assert [client.sent for client in clients] == [4] * 5  # each its own closed loop
    assert all(client.finished for client in clients)
    assert len(done) == 20 and all(stream.tokens == 3 for stream in done)
    assert wall > 0


def test_the_clients_are_closed_when_a_request_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    RecordingClient.made = []
    monkeypatch.setattr(bench_http.httpx, "AsyncClient", FailingClient)
    with pytest.raises(httpx.HTTPStatusError):
        asyncio.run(bench_http.closed_loops("http://server", [1], 3, 3, 0.0, 1))
    assert len(RecordingClient.made) == 3
    assert all(client.finished for client in RecordingClient.made)


def test_the_collector_is_off_while_requests_are_timed_and_on_again_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    RecordingClient.collector_on = []
    monkeypatch.setattr(bench_http.httpx, "AsyncClient", RecordingClient)
    assert gc.isenabled()
    asyncio.run(bench_http.closed_loops("http://server", [1], 3, 3, min_seconds=0.0, min_rounds=2))
    assert RecordingClient.collector_on == [False] * 6
    assert gc.isenabled()
    monkeypatch.setattr(bench_http.httpx, "AsyncClient", FailingClient)
    with pytest.raises(httpx.HTTPStatusError):
        asyncio.run(bench_http.closed_loops("http://server", [1], 2, 3, 0.0, 1))
    assert gc.isenabled()
