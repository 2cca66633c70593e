"""The engine process's life seen from the API: killed mid-stream, it fails the stream with a
503 event, the server answers 503 while it is down, and a new engine serves again; shut down,
it fails what is left with a 503 and exits by itself. (Cancellation, timeouts and a failing row
across the same boundary: test_streaming.py, test_errors.py, test_isolation.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import server.api.client
from model.kernels import decode_step
from model.sampling import SamplingParams
from server.api.job import Failure, Job
from server.api.service import Service
from server.api.settings import Settings
from server.messages import Token
from tests.server.conftest import (
    Running,
    running_server,
    sse_events,
    test_settings,
    wait_for,
)

MODEL = "rope"
BODY = {"model": MODEL, "prompt": "To be", "max_tokens": 40, "seed": 5, "ignore_eos": True}


@pytest.fixture
def lone_server(checkpoints: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Running]:
    """A server of its own (its engine gets killed); a restart delay long enough to see the
    server without an engine."""
    monkeypatch.setattr(server.api.client, "RESTART_DELAY", 2.0)
    settings = test_settings(checkpoints, models=[MODEL], stream_interval=0)
    with running_server(settings) as running:
        yield running


def test_a_killed_engine_fails_its_streams_answers_503_and_comes_back(
    lone_server: Running,
) -> None:
    client = httpx.Client(base_url=lone_server.url, timeout=60)
    expected = client.post("/v1/completions", json=BODY).json()["choices"][0]["text"]
    engine = lone_server.service.engine
    assert engine is not None
    victim = engine.pid
    assert victim is not None and victim == lone_server.control.call("pid")
    gate = lone_server.gate(MODEL)
    events: list[Any] = []
    with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as response:
        lines = response.iter_lines()
        gate.allow(2)  # the prompt and one decode step: two tokens, then the model is held
        for event in sse_events(lines):
            events.append(event)
            if len(events) == 1:  # both tokens (one event if they arrived together)
                wait_for(lambda: gate.settled, "the two steps")
                os.kill(victim, signal.SIGKILL)
        assert response.status_code == 200
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "engine_restarting" and "restarting" in error["message"]
    assert all("choices" in event for event in events[:-2])  # the tokens before it got through

    down = client.post("/v1/completions", json=BODY)  # before the restart delay has passed
    assert down.status_code == 503 and down.json()["error"]["type"] == "server_error"
    assert client.get("/health").status_code == 503
    assert client.get("/health").json()["models"][MODEL]["state"] == "loading"

    wait_for(lambda: MODEL in lone_server.service.models, "the new engine", timeout=300)
    assert engine.pid not in (None, victim)
    again = client.post("/v1/completions", json=BODY)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected
    registry = lone_server.service.metrics.registry
    labels = {"model_name": MODEL, "reason": "engine_lost"}
    assert registry.get_sample_value("ordinal_request_failures_total", labels) == 1
    assert lone_server.service.models[MODEL].engine.in_flight == 0
    client.close()


def test_shutdown_fails_what_is_left_and_the_engine_exits_by_itself(checkpoints: Path) -> None:
    async def scenario() -> tuple[list[Any], int | None, list[Any]]:
        service = Service(test_settings(checkpoints, models=[MODEL], stream_interval=0))
        await service.load()
        while not service.settled:
            await asyncio.sleep(0.01)
        served = service.models[MODEL]
        job = Job([served.bos, 5, 6], SamplingParams(seed=1), max_tokens=100)
        served.engine.submit(job)
        received = [await job.events.get()]  # its first token: it is decoding
        assert service.engine is not None
        process = service.engine.process
        assert process is not None
        await service.close()
        while not job.events.empty():
            received.append(job.events.get_nowait())
        late = Job([served.bos, 5], SamplingParams(), max_tokens=1)
        refused = []
        try:
            served.engine.submit(late)
        except Exception as error:
            refused.append(error)
        return received, service.engine.exitcode, refused

    received, exitcode, refused = asyncio.run(scenario())
    assert isinstance(received[0], Token)
    failure = received[-1]
    assert isinstance(failure, Failure) and failure.error.status == 503
    assert "shutting down" in failure.error.message
    assert all(isinstance(event, Token) for event in received[:-1])
    assert exitcode == 0  # it exited by itself, not killed
    assert [getattr(error, "status", None) for error in refused] == [503]


def test_an_idle_models_cache_stays_grown_for_the_next_request_then_shrinks(
    server: Running,
) -> None:
    """The KV cache a long prompt grew is still there when the next request comes (no new
    allocation in its time to first token), and given back once the model has been idle."""
    server.control.call("idle_shrink", 1.0)
    try:
        first = server.control.call("allocated", MODEL)
        prompt = " ".join(["the king"] * 20)  # past the 64 positions a cache starts with
        client = httpx.Client(base_url=server.url, timeout=60)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        grown = server.control.call("allocated", MODEL)
        assert grown[1] > first[1]  # the request has ended, and the growth is kept
        wait_for(lambda: server.control.call("allocated", MODEL) < grown, "the cache to shrink")
        client.close()
    finally:
        server.control.call("idle_shrink", 2.0)


@pytest.mark.skipif(not decode_step.ready(), reason="the decode-step kernel needs AVX-512")
@pytest.mark.parametrize("helper", [True, False])
def test_large_steps_share_their_attention_as_the_settings_say(
    checkpoints: Path, helper: bool
) -> None:
    """``--attention-helper`` (on by default) reaches the engine process's decode kernel; on a
    machine with one core it stays off there (a helper would take the decode loop's core)."""
    assert Settings.model_fields["attention_helper"].default is True
    settings = test_settings(checkpoints, models=[MODEL], attention_helper=helper)
    with running_server(settings) as running:
        shared = running.control.call("shares_large_steps")
    expected = helper and decode_step.ready() and len(os.sched_getaffinity(0)) > 1
    assert shared == expected


def test_the_decode_loop_runs_on_the_threads_asked_for(checkpoints: Path) -> None:
    """``--threads 2``: the decode kernel's loops run on two threads in the decode loop, though
    the loader thread set torch's count to 1 for itself (each kernel library copies that shared
    count on its first loop in a thread, after the model has loaded)."""
    with running_server(test_settings(checkpoints, models=[MODEL], threads=2)) as running:
        running.control.call("count_threads", MODEL)
        with httpx.Client(base_url=running.url, timeout=60) as client:
            response = client.post("/v1/completions", json={**BODY, "max_tokens": 4})
        assert response.status_code == 200, response.text
        seen = running.control.call("threads_seen", MODEL)
        assert len(seen) >= 4 and set(seen) == {2}
