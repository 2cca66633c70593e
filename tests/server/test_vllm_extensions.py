"""What clients written for vLLM send and ask, tried as they send it: guidellm's
``stream_options.continuous_usage_stats``, lm-evaluation-harness's ``GET /tokenizer_info``, and
a 400 that names the innermost field at fault, with the reason in the server's log."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import orjson
import pytest

from model.tokenizer import BOS, EOS
from tests.server.conftest import Running

BODY = {"model": "rope", "prompt": "To be", "max_tokens": 6, "ignore_eos": True, "seed": 2}


def stream(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(orjson.loads(line.removeprefix("data: ")))
    return chunks


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", BODY),
        (
            "/v1/chat/completions",
            {**BODY, "prompt": None, "messages": [{"role": "user", "content": "Hi"}]},
        ),
    ],
)
def test_continuous_usage_stats_puts_usage_on_every_chunk(
    client: httpx.Client, path: str, body: dict[str, Any]
) -> None:
    body = {key: value for key, value in body.items() if value is not None}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stream(client, path, {**body, "stream_options": options})
    *with_choices, last = chunks
    assert with_choices and not last["choices"]
    assert all(chunk["usage"] is not None for chunk in chunks)
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    prompt = last["usage"]["prompt_tokens"]
    assert all(chunk["usage"]["prompt_tokens"] == prompt for chunk in chunks)
    assert all(
        chunk["usage"]["total_tokens"] == prompt + chunk["usage"]["completion_tokens"]
        for chunk in chunks
    )


@pytest.mark.parametrize("value", [False, None])
def test_continuous_usage_stats_false_or_null_is_accepted(
    client: httpx.Client, value: bool | None
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": value}
    chunks = stream(client, "/v1/completions", {**BODY, "stream_options": options})
    *with_choices, last = chunks
    assert all(chunk["usage"] is None for chunk in with_choices)
    assert last["usage"]["completion_tokens"] == 6


def test_a_400_names_the_innermost_field_and_the_log_says_why(
    client: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="ordinal.server"):
        answer = client.post(
            "/v1/completions", json={**BODY, "stream_options": {"include_usage": "yes"}}
        )
        chat = client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": 5}]},
        )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "stream_options"
    assert error["message"].startswith("stream_options.include_usage: ")
    assert chat.status_code == 400
    assert chat.json()["error"]["message"].startswith("messages[1].content: ")
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused")]
    assert any("/v1/completions: 400 stream_options.include_usage" in r for r in refusals)
    assert any("/v1/chat/completions: 400 messages[1].content: " in r for r in refusals)


def test_tokenizer_info_as_vllm_serves_it(server: Running, client: httpx.Client) -> None:
    info = client.get("/tokenizer_info", params={"model": "alibi"})
    assert info.status_code == 200
    body = info.json()
    assert body["tokenizer_class"]
    assert (body["bos_token"], body["eos_token"]) == (BOS, EOS)
    assert body["chat_template"] == server.service.models["alibi"].chat_template.source
    assert body["model_max_length"] == server.service.models["alibi"].max_context
    assert client.get("/tokenizer_info").status_code == 200  # the default model
    missing = client.get("/tokenizer_info", params={"model": "nope"})
    assert missing.status_code == 404
