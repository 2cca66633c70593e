"""Automatic prefix caching through the server: a prompt sent again reports the tokens it reused
in ``usage`` (completions, chat and responses, OpenAI's shapes), its answer is the one it got
the first time, /metrics counts vLLM's prefix-cache queries and hits, and
``--prefix-cache-tokens 0`` turns it off."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from model.prefix_cache import BLOCK
from tests.server.conftest import TEXT, Running, running_server, test_settings

# Long enough for a few blocks of the tiny tokenizer's tokens; used by no other test.
SCENE = "Prefix:\n" + " ".join(TEXT[:2])


def reusable(prompt_tokens: int) -> int:
    """What a prompt sent again reuses: its whole blocks, less the last token, always fed."""
    return min(prompt_tokens // BLOCK * BLOCK, prompt_tokens - 1)


def counter(metrics: str, name: str) -> float:
    match = re.search(rf'^ordinal_{name}_total{{model_name="rope"}} (\S+)$', metrics, re.M)
    assert match, name
    return float(match[1])


def completion(client: httpx.Client, prompt: str) -> dict[str, Any]:
    body = {"model": "rope", "prompt": prompt, "max_tokens": 6, "logprobs": 1, "seed": 5}
    response = client.post("/v1/completions", json={**body, "temperature": 0.8})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_prompt_sent_again_reuses_its_blocks_and_answers_the_same(
    client: httpx.Client,
) -> None:
    before = client.get("/metrics").text
    first = completion(client, SCENE + " completions")
    again = completion(client, SCENE + " completions")
    prompt = first["usage"]["prompt_tokens"]
    assert prompt > 2 * BLOCK
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": reusable(prompt)}
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    ours, theirs = (answer["choices"][0]["logprobs"]["token_logprobs"] for answer in (again, first))
    assert ours == pytest.approx(theirs, abs=1e-5)
    after = client.get("/metrics").text
    queries = counter(after, "prefix_cache_queries") - counter(before, "prefix_cache_queries")
    hits = counter(after, "prefix_cache_hits") - counter(before, "prefix_cache_hits")
    assert (queries, hits) == (2 * prompt, reusable(prompt))


def test_chat_and_responses_report_their_cached_tokens(client: httpx.Client) -> None:
    chat = {
        "model": "rope",
        "messages": [{"role": "system", "content": TEXT[2]}, {"role": "user", "content": "Chat?"}],
        "max_tokens": 3,
    }
    first, again = (client.post("/v1/chat/completions", json=chat).json() for _ in range(2))
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    prompt = again["usage"]["prompt_tokens"]
    assert prompt > BLOCK
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": reusable(prompt)}

    responses = {"model": "rope", "input": "Responses?", "instructions": TEXT[0]}
    responses["max_output_tokens"] = 3
    first, again = (client.post("/v1/responses", json=responses).json() for _ in range(2))
    assert first["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    prompt = again["usage"]["input_tokens"]
    assert again["usage"]["input_tokens_details"] == {"cached_tokens": reusable(prompt)}


def test_streamed_usage_carries_the_cached_tokens(server: Running) -> None:
    body = {
        "model": "rope",
        "prompt": SCENE + " streamed",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(base_url=server.url, timeout=30) as client:
        completion(client, SCENE + " streamed")
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    usage = orjson.loads(lines[-1].removeprefix("data: "))["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": reusable(usage["prompt_tokens"])}


def test_no_prefix_cache_tokens_turns_it_off(checkpoints: Path) -> None:
    settings = test_settings(checkpoints, models=["rope"], prefix_cache_tokens=0)
    with (
        running_server(settings) as running,
        httpx.Client(base_url=running.url, timeout=30) as client,
    ):
        first = completion(client, SCENE)
        again = completion(client, SCENE)
        metrics = client.get("/metrics").text
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert counter(metrics, "prefix_cache_queries") == counter(metrics, "prefix_cache_hits") == 0
