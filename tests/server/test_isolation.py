"""A request whose sampling fails fails alone: the streams decoding beside it finish, each
token-identical to its solo run, and the failure is counted by reason."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import (
    Running,
    running_server,
    sse_events,
    test_settings,
    wait_for,
)

MODEL = "rope"
BAD_SEED = 666
FAILS_AT_TOKEN = 3  # the bad request fails mid-stream, while the others decode


def stream_body(seed: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": "To be, or not",
        "max_tokens": 12,
        "ignore_eos": True,
        "seed": seed,
        "temperature": 1.2,
        "top_k": 40 if seed % 2 else 0,  # both sampling paths
        "repetition_penalty": 1.3 if seed % 3 == 0 else 1.0,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
        "stream": True,
    }


async def stream(client: httpx.AsyncClient, body: dict[str, Any]) -> list[Any]:
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines()]
    return list(sse_events(iter(lines)))


def tokens_of(events: list[Any]) -> list[str]:
    choices = [
        event["choices"][0] for event in events if isinstance(event, dict) and "choices" in event
    ]
    return [
        token for choice in choices if choice["logprobs"] for token in choice["logprobs"]["tokens"]
    ]


def failures(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    family = next(
        f for f in text_string_to_metric_families(text) if f.name == "ordinal_request_failures"
    )
    return {
        s.labels["reason"]: s.value
        for s in family.samples
        if s.labels["model_name"] == MODEL and s.name.endswith("_total")
    }


@pytest.fixture(scope="module")
def wide_server(checkpoints: Path) -> Iterator[Running]:
    """Room for the 8 streams and the bad one in one batch."""
    settings = test_settings(checkpoints, models=[MODEL], max_batch_size=12, stream_interval=0)
    with running_server(settings) as running:
        yield running


def make_nan_logits(running: Running) -> None:
    """The bad request's logits turn NaN once it has generated a few tokens."""
    running.control.call("poison", MODEL, BAD_SEED, FAILS_AT_TOKEN)


def make_sampler_raise(running: Running) -> None:
    """The bad request's own sampler raises on a later draw."""
    running.control.call("failing_sampler", BAD_SEED, FAILS_AT_TOKEN)


@pytest.mark.parametrize(
    ("breakage", "reason"),
    [(make_nan_logits, "non_finite_logits"), (make_sampler_raise, "sampling_error")],
)
def test_one_failing_request_leaves_eight_streams_untouched(
    wide_server: Running, breakage: Any, reason: str
) -> None:
    seeds = list(range(1, 9))
    engine = wide_server.engine(MODEL)

    async def run(bodies: list[dict[str, Any]]) -> list[list[Any]]:
        async with httpx.AsyncClient(base_url=wide_server.url, timeout=60) as client:
            return await asyncio.gather(*(stream(client, body) for body in bodies))

    solo = [asyncio.run(run([stream_body(seed)]))[0] for seed in seeds]
    counted = failures(wide_server.url)
    breakage(wide_server)  # in the engine process
    gate = wide_server.gate(MODEL)  # holds the model until all nine are in: one batch

    async def all_nine() -> list[list[Any]]:
        running = asyncio.ensure_future(run([stream_body(BAD_SEED), *map(stream_body, seeds)]))
        while engine.in_flight < 9:
            await asyncio.sleep(0.005)
        gate.open()
        return await running

    try:
        together = asyncio.run(all_nine())
    finally:
        gate.open()
        wide_server.control.call("reset")
    bad, good = together[0], together[1:]

    assert bad[-1] == "[DONE]"
    error = bad[-2]["error"]
    assert error["type"] == "server_error" and error["code"] == "sampling_failed"
    assert "not affected" in error["message"]
    # It streamed, then failed mid-way (a token ending inside a UTF-8 character is held back).
    assert 0 < len(tokens_of(bad)) <= FAILS_AT_TOKEN
    for seed, alone, beside in zip(seeds, solo, good, strict=True):
        assert tokens_of(beside) == tokens_of(alone), seed
        assert len(tokens_of(beside)) == 12
        assert beside[-2]["choices"][0]["finish_reason"] == "length"
    after = failures(wide_server.url)
    assert after[reason] - counted[reason] == 1
    assert sum(after.values()) - sum(counted.values()) == 1
    wait_for(lambda: engine.in_flight == 0, "every row to be freed")
