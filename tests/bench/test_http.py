"""bench.http's load generator: each simulated client has its own session, as separate users
do, and every one is closed when its level ends; Python's garbage collector does not run while
requests are timed; each streamed token is timed and the usage read.

The figures themselves are measurements (``make bench``); what is checked is how the load is
sent, against a small aiohttp server on the loopback, in the test's own event loop.
"""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench import http as bench_http

TEXTS = ("a", "b", "c")
EVENTS = (
    b"".join(
        b"data: " + json.dumps({"choices": [{"text": text}]}).encode() + b"\n\n" for text in TEXTS
    )
    + b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\n'
    + b"data: [DONE]\n\n"
)


class FakeServer:
    """Answers every completion with ``events`` (three streamed tokens; or ``status``), noting
    for each request the client's port (one per connection) and whether the collector was on."""

    def __init__(self, status: int = 200, events: bytes = EVENTS) -> None:
        self.status = status
        self.events = events
        self.ports: list[int] = []
        self.collector_on: list[bool] = []

    async def completion(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.ports.append(peer[1] if peer else -1)
        self.collector_on.append(gc.isenabled())
        if self.status != 200:
            return web.Response(status=self.status, text="no")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for line in self.events.split(b"\n\n")[:-1]:  # each event written on its own
            await response.write(line + b"\n\n")
        await response.write_eof()
        return response


def against(fake: FakeServer, work: Callable[[str], Awaitable[Any]]) -> Any:
    """Run ``work(url)`` against ``fake`` served on the loopback."""

    async def scenario() -> Any:
        app = web.Application()
        app.router.add_post("/v1/completions", fake.completion)
        async with TestServer(app, host="127.0.0.1") as server:
            return await work(str(server.make_url("")).rstrip("/"))

    return asyncio.run(scenario())


@pytest.fixture
def sessions(monkeypatch: pytest.MonkeyPatch) -> list[aiohttp.ClientSession]:
    """Every session bench.http opens, in order."""
    made: list[aiohttp.ClientSession] = []
    original = bench_http.session

    def recording(url: str, connections: int = 100) -> aiohttp.ClientSession:
        made.append(original(url, connections))
        return made[-1]

    monkeypatch.setattr(bench_http, "session", recording)
    return made


def test_each_closed_loop_has_its_own_session_and_all_are_closed(
    sessions: list[aiohttp.ClientSession],
) -> None:
    fake = FakeServer()
    done, wall = against(
        fake, lambda url: bench_http.closed_loops(url, [1, 2, 3], 5, 3, 0.0, min_rounds=4)
    )
    assert len(sessions) == 5 and all(session.closed for session in sessions)
    # one kept-alive connection per simulated user: 5 ports, 4 requests each
    assert sorted(fake.ports.count(port) for port in set(fake.ports)) == [4] * 5
    assert len(done) == 20
    assert all(len(stream.token_times) == 3 and stream.tokens == 3 for stream in done)
    assert all(stream.sent <= stream.token_times[0] for stream in done)
    assert wall > 0


def test_the_sessions_are_closed_when_a_request_fails(
    sessions: list[aiohttp.ClientSession],
) -> None:
    with pytest.raises(aiohttp.ClientResponseError):
        against(FakeServer(500), lambda url: bench_http.closed_loops(url, [1], 3, 3, 0.0, 1))
    assert len(sessions) == 3 and all(session.closed for session in sessions)


def test_the_collector_is_off_while_requests_are_timed_and_on_again_after() -> None:
    fake = FakeServer()
    assert gc.isenabled()
    against(fake, lambda url: bench_http.closed_loops(url, [1], 3, 3, 0.0, min_rounds=2))
    assert fake.collector_on == [False] * 6
    assert gc.isenabled()
    with pytest.raises(aiohttp.ClientResponseError):
        against(FakeServer(500), lambda url: bench_http.closed_loops(url, [1], 2, 3, 0.0, 1))
    assert gc.isenabled()


def test_an_error_event_mid_stream_raises() -> None:
    class Failing(FakeServer):
        async def completion(self, request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b'data: {"error": {"message": "boom"}}\n\n')
            await response.write_eof()
            return response

    async def one(url: str) -> bench_http.Stream:
        async with bench_http.session(url) as client:
            return await bench_http.stream_completion(client, [1], 3, seed=None)

    with pytest.raises(RuntimeError, match="boom"):
        against(Failing(), one)
