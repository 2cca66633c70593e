"""Hostile input, as a fuzzer or an attacker sends it: each gets its 4xx and OpenAI's error body
(``type``, ``code``, ``param`` and a message that says what is wrong), never a 5xx; the
connection stays usable and every answer is counted. Values the sampler cannot divide by or
hold in its dtype are refused or clamped by a documented rule (``server.api.schemas``)."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.api import routes
from tests.server.conftest import Running

OK = {"prompt": "To be"}
JSON = {"content-type": "application/json"}
INVALID = ("invalid_request_error", "invalid_value")  # (type, code) of a bad field
UNPARSABLE = ("invalid_request_error", None)  # a body Python's JSON parser gives up on


class Hostile(NamedTuple):
    name: str
    path: str
    body: dict[str, Any] | bytes  # bytes: sent as they are, with a JSON content type
    status: int
    param: str | None
    kind: tuple[str, str | None]  # the error's (type, code)
    says: str  # a fragment the message must hold


def nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


C, T = "/v1/completions", "/v1/tokenize"  # short: the table stays readable
HOSTILE = [
    # values that passed validation before and broke the sampler's arithmetic
    Hostile("penalty 1e-300", C, {**OK, "repetition_penalty": 1e-300}, 400, "repetition_penalty", INVALID, "0.01"),  # noqa: E501
    Hostile("penalty 1e300", C, {**OK, "repetition_penalty": 1e300}, 400, "repetition_penalty", INVALID, "100"),  # noqa: E501
    Hostile("negative penalty", C, {**OK, "repetition_penalty": -2.0}, 400, "repetition_penalty", INVALID, "0.01"),  # noqa: E501
    Hostile("top_k a string", C, {**OK, "top_k": "5"}, 400, "top_k", INVALID, "integer"),
    Hostile("top_k -2**63", C, {**OK, "top_k": -(2**63)}, 400, "top_k", INVALID, "greater than"),
    # NaN and Infinity literals (Python's parser accepts them) and numbers that overflow
    Hostile("temperature NaN", C, b'{"prompt": "a", "temperature": NaN}', 400, "temperature", INVALID, "finite"),  # noqa: E501
    Hostile("temperature Infinity", C, b'{"prompt": "a", "temperature": Infinity}', 400, "temperature", INVALID, "finite"),  # noqa: E501
    Hostile("temperature 1e999", C, b'{"prompt": "a", "temperature": 1e999}', 400, "temperature", INVALID, "finite"),  # noqa: E501
    Hostile("top_p NaN", C, b'{"prompt": "a", "top_p": NaN}', 400, "top_p", INVALID, "finite"),
    Hostile("min_p -Infinity", C, b'{"prompt": "a", "min_p": -Infinity}', 400, "min_p", INVALID, "finite"),  # noqa: E501
    Hostile("penalty NaN", C, b'{"prompt": "a", "repetition_penalty": NaN}', 400, "repetition_penalty", INVALID, "finite"),  # noqa: E501
    Hostile("temperature 'NaN'", C, {**OK, "temperature": "NaN"}, 400, "temperature", INVALID, "number"),  # noqa: E501
    Hostile("a 5000-digit number", C, b'{"prompt": "a", "top_k": ' + b"9" * 5000 + b"}", 400, None, UNPARSABLE, "parsing"),  # noqa: E501
    # huge and negative numbers
    Hostile("max_tokens 2**70", C, {**OK, "max_tokens": 2**70}, 400, "max_tokens", ("invalid_request_error", "context_length_exceeded"), "tokens are left"),  # noqa: E501
    Hostile("max_tokens -2**63", C, {**OK, "max_tokens": -(2**63)}, 400, "max_tokens", INVALID, "greater than"),  # noqa: E501
    Hostile("max_tokens 1e3 (a float)", C, {**OK, "max_tokens": 1e3}, 400, "max_tokens", INVALID, "integer"),  # noqa: E501
    Hostile("seed 2**200", C, {**OK, "seed": 2**200}, 400, "seed", INVALID, "less than"),
    Hostile("logprobs 10**30", C, {**OK, "logprobs": 10**30}, 400, "logprobs", INVALID, "less than"),  # noqa: E501
    Hostile("logprobs true", C, {**OK, "logprobs": True}, 400, "logprobs", INVALID, "integer"),
    Hostile("n 0", C, {**OK, "n": 0}, 400, "n", INVALID, "1"),
    # out-of-vocabulary and malformed token ids
    Hostile("token id 2**63", C, {"prompt": [1, 2**63]}, 400, "prompt", ("invalid_request_error", None), "vocabulary"),  # noqa: E501
    Hostile("token id 2**64 + 5", C, {"prompt": [2**64 + 5]}, 400, "prompt", ("invalid_request_error", None), "vocabulary"),  # noqa: E501
    Hostile("token ids as floats", C, {"prompt": [1.0, 2.0]}, 400, "prompt", INVALID, "integer"),
    Hostile("prompts mixing texts and ids", C, {"prompt": ["a", [1]]}, 400, "prompt", INVALID, "string"),  # noqa: E501
    Hostile("prompts nested too deep", C, {"prompt": [[[1]]]}, 400, "prompt", INVALID, "integer"),
    Hostile("an unsupported OpenAI field", C, {**OK, "best_of": 3}, 400, "best_of", INVALID, "not supported"),  # noqa: E501
    Hostile("logit_bias past the vocabulary", C, {**OK, "logit_bias": {"99999": 1}}, 400, "logit_bias", ("invalid_request_error", None), "vocabulary"),  # noqa: E501
    Hostile("logit_bias past 100", C, {**OK, "logit_bias": {"5": 101}}, 400, "logit_bias", INVALID, "100"),  # noqa: E501
    Hostile("logit_bias keyed by text", C, {**OK, "logit_bias": {"the": 1}}, 400, "logit_bias", INVALID, "pattern"),  # noqa: E501
    Hostile("frequency_penalty 2.5", C, {**OK, "frequency_penalty": 2.5}, 400, "frequency_penalty", INVALID, "2"),  # noqa: E501
    Hostile("prompt null", C, {"prompt": None}, 400, "prompt", INVALID, "string"),
    # invalid Unicode: lone surrogates in every string field, invalid UTF-8 in the body
    Hostile("surrogate in prompt", C, {"prompt": "a\ud800b"}, 400, "prompt", INVALID, "lone surrogate"),  # noqa: E501
    Hostile("surrogate in stop", C, {**OK, "stop": ["\udfff"]}, 400, "stop", INVALID, "lone surrogate"),  # noqa: E501
    Hostile("surrogate in model", C, {**OK, "model": "\ud83d"}, 400, "model", INVALID, "lone surrogate"),  # noqa: E501
    Hostile("surrogate in user", C, {**OK, "user": "\udc00x"}, 400, "user", INVALID, "lone surrogate"),  # noqa: E501
    Hostile("surrogate to tokenize", T, {"prompt": "\ud800"}, 400, "prompt", INVALID, "lone surrogate"),  # noqa: E501
    Hostile("invalid UTF-8", C, b'{"prompt": "\xff\xfe"}', 400, None, UNPARSABLE, "parsing"),
    Hostile("UTF-8 cut mid-character", C, b'{"prompt": "caf\xc3"}', 400, None, UNPARSABLE, "parsing"),  # noqa: E501
    # deep nesting and bodies that are not objects
    Hostile("prompt nested 100,000 deep", C, nested(100_000), 400, None, UNPARSABLE, "parsing"),
    Hostile("unknown field nested 50,000 deep", C, b'{"prompt": "a", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, None, UNPARSABLE, "parsing"),  # noqa: E501
    Hostile("a body that is a list", C, b"[1, 2, 3]", 400, None, ("invalid_request_error", "invalid_body"), "JSON object"),  # noqa: E501
    Hostile("truncated JSON", C, b'{"prompt": "a', 400, None, ("invalid_request_error", "invalid_json"), "not valid JSON"),  # noqa: E501
    Hostile("an unknown field", C, {**OK, "__proto__": {}}, 400, "__proto__", INVALID, "not permitted"),  # noqa: E501
    Hostile("stream_options with a string", C, {**OK, "stream_options": {"include_usage": "yes"}}, 400, "stream_options", INVALID, "boolean"),  # noqa: E501
    Hostile("echo null", C, {**OK, "echo": None}, 400, "echo", INVALID, "boolean"),
    Hostile("model a number", C, {**OK, "model": 7}, 400, "model", INVALID, "string"),
    Hostile("tokenize a list", T, {"prompt": [1, 2]}, 400, "prompt", INVALID, "string"),
    Hostile("tokenize add_special_tokens 'no'", T, {"prompt": "a", "add_special_tokens": "no"}, 400, "add_special_tokens", INVALID, "boolean"),  # noqa: E501
    # sizes, models and routes that do not exist
    Hostile("a prompt far past the context", C, {"prompt": "to be or not " * 20_000}, 400, "prompt", ("invalid_request_error", "context_length_exceeded"), "at most"),  # noqa: E501
    Hostile("an oversize body", C, {"prompt": "x" * 1_000_001}, 413, None, ("invalid_request_error", None), "larger than"),  # noqa: E501
    Hostile("an unknown model", C, {**OK, "model": "gpt-5"}, 404, "model", ("invalid_request_error", "model_not_found"), "does not exist"),  # noqa: E501
    Hostile("tokenize an unknown model", T, {"prompt": "a", "model": "../rope"}, 404, "model", ("invalid_request_error", "model_not_found"), "does not exist"),  # noqa: E501
]  # fmt: skip


def post(client: httpx.Client, case: Hostile) -> httpx.Response:
    if isinstance(case.body, bytes):
        return client.post(case.path, content=case.body, headers=JSON)
    return client.post(case.path, content=json.dumps(case.body).encode(), headers=JSON)


def requests_counted(client: httpx.Client) -> dict[str, float]:
    """Answered requests by status, over every route."""
    families = text_string_to_metric_families(client.get("/metrics").text)
    counter = next(family for family in families if family.name == "ordinal_requests")
    counted: dict[str, float] = {}
    for sample in counter.samples:
        if sample.name.endswith("_total"):
            status = sample.labels["status"]
            counted[status] = counted.get(status, 0.0) + sample.value
    return counted


def test_the_table_is_large() -> None:
    assert len(HOSTILE) >= 40
    assert len({case.name for case in HOSTILE}) == len(HOSTILE)


@pytest.mark.parametrize("case", HOSTILE, ids=[case.name for case in HOSTILE])
def test_hostile_input_gets_its_4xx(server: Running, case: Hostile) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        before = requests_counted(client)
        response = post(client, case)
        assert response.status_code == case.status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == case.kind, error
        assert error["param"] == case.param, error
        assert case.says in error["message"], error
        if case.param is not None and case.status == 400:
            assert case.param in error["message"], error
        # The connection stays open and usable, and the answer was counted.
        assert response.headers.get("connection") != "close"
        assert client.post(C, json={**OK, "max_tokens": 1}).status_code == 200
        after = requests_counted(client)
        status = str(case.status)
        assert after[status] - before.get(status, 0) == 1


def test_streams_are_refused_the_same_way(server: Running) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for case in HOSTILE:
            if case.path == C and isinstance(case.body, dict) and case.status == 400:
                body = json.dumps({**case.body, "stream": True}).encode()
                response = client.post(C, content=body, headers=JSON)
                assert response.status_code == 400, (case.name, response.text)
                assert response.json()["error"]["param"] == case.param


def greedy_text(client: httpx.Client, **sampling: Any) -> str:
    body = {"model": "rope", "prompt": "To be", "max_tokens": 8, "ignore_eos": True, "seed": 3}
    response = client.post(C, json={**body, **sampling})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_values_past_what_the_sampler_holds_are_clamped_by_the_documented_rule(
    client: httpx.Client,
) -> None:
    """A temperature below 1e-5 (even a float32 subnormal) is greedy; a top_k past the
    vocabulary (even past int64) is the whole vocabulary."""
    greedy = greedy_text(client, temperature=0)
    assert greedy_text(client, temperature=1e-40) == greedy
    assert greedy_text(client, temperature=9e-6) == greedy
    sampled = greedy_text(client, temperature=1.5)
    assert greedy_text(client, temperature=1.5, top_k=2**63) == sampled
    assert greedy_text(client, temperature=1.5, top_k=10**40) == sampled


def test_an_unexpected_exception_is_a_counted_500_in_openai_shape(
    server: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: Any, **kwargs: Any) -> list[int]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(routes, "tokenised", broken)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        before = requests_counted(client)
        response = client.post(T, json={"prompt": "a"})
        assert response.status_code == 500
        assert response.json() == {
            "error": {
                "message": "internal server error",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        }
        assert "a bug" not in response.text  # no internals leak
        assert response.headers.get("connection") != "close"
        monkeypatch.undo()
        assert client.post(T, json={"prompt": "a"}).status_code == 200  # same connection
        assert requests_counted(client)["500"] - before.get("500", 0) == 1
