"""For every scheme, the logprobs of generated tokens (cached, one token per step) equal those of
scoring the prompt plus the completion in one full forward pass (``echo`` with max_tokens 0)."""

from __future__ import annotations

import httpx
import orjson
import pytest

from model.positional import SCHEMES

PROMPT = "Now is the winter of"
TOP = 3


def post(client: httpx.Client, body: dict) -> dict:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_decoding_logprobs_equal_full_forward_scores(client: httpx.Client, scheme: str) -> None:
    common = {"model": scheme, "logprobs": TOP, "return_tokens_as_token_ids": True}
    generated = post(client, {**common, "prompt": PROMPT, "max_tokens": 40, "seed": 5})
    decoded = generated["logprobs"]
    ids = [int(token.removeprefix("token_id:")) for token in decoded["tokens"]]
    prompt_ids = client.post("/v1/tokenize", json={"model": scheme, "prompt": PROMPT}).json()
    prompt_ids = prompt_ids["tokens"]

    scored = post(client, {**common, "prompt": prompt_ids + ids, "max_tokens": 0, "echo": True})
    scores = scored["logprobs"]
    assert scored["finish_reason"] == "length"
    assert scores["tokens"] == [f"token_id:{token}" for token in prompt_ids + ids]
    assert scores["token_logprobs"][0] is None and scores["top_logprobs"][0] is None
    assert scored["text"] == PROMPT + generated["text"]

    after_prompt = len(prompt_ids)
    assert scores["token_logprobs"][after_prompt:] == pytest.approx(
        decoded["token_logprobs"], abs=1e-3
    )
    pairs = zip(scores["top_logprobs"][after_prompt:], decoded["top_logprobs"], strict=True)
    for full, cached in pairs:
        assert len(cached) == TOP
        assert list(full.values()) == pytest.approx(list(cached.values()), abs=1e-3)
        assert set(full) == set(cached)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_alone_returns_the_prompt(client: httpx.Client, stream: bool) -> None:
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "stream": stream}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200
    if stream:
        lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) == 2
        choice = orjson.loads(lines[0].removeprefix("data: "))["choices"][0]
    else:
        choice = response.json()["choices"][0]
        assert response.json()["usage"]["completion_tokens"] == 0
    assert (choice["text"], choice["finish_reason"], choice["logprobs"]) == (PROMPT, "length", None)
