"""``POST /v1/trace`` against the tiny checkpoints of every scheme: the attention, positional and
next-token pieces are checked against the model's own tensors and against what
``/v1/completions`` scores and samples."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import httpx
import pytest
import torch

from model.positional import SCHEMES
from model.positional.t5 import relative_position_bucket
from model.transformer import Transformer
from server.schemas import MAX_TRACE_TOKENS
from tests.server.conftest import Running

PROMPT = "To be, or not to be, that is the question"
# About 45 tokens: past t5's max_distance (24), within the table schemes' 64 positions.
LONG_PROMPT = "All the world's a stage, and all the men and women merely players. All the world's"
ADDITIVE = ("integer", "binary", "sinusoidal", "learned", "mds", "lowrank")


def trace(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/trace", json={"prompt": PROMPT, **body})
    assert response.status_code == 200, response.text
    return response.json()


def model_of(server: Running, name: str) -> Transformer:
    return server.service.models[name].model


def stage(result: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in result["next_token"]["stages"] if s["name"] == name)


def probs_of(stage: dict[str, Any]) -> dict[int, float]:
    return {entry["id"]: entry["prob"] for entry in stage["top"]}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_attention_rows_are_causal_and_sum_to_one(client: httpx.Client, scheme: str) -> None:
    result = trace(client, model=scheme)
    ids = client.post("/v1/tokenize", json={"model": scheme, "prompt": PROMPT}).json()["tokens"]
    assert [token["id"] for token in result["tokens"]] == ids
    length = len(ids)
    assert result["positions"] == list(range(length))
    attention = torch.tensor(result["attention"])
    assert attention.shape == (result["n_layers"], result["n_heads"], length, length)
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    assert (attention[..., future] == 0).all()
    assert (attention >= 0).all()
    torch.testing.assert_close(
        attention.sum(-1), torch.ones(attention.shape[:-1]), atol=1e-4, rtol=0
    )
    assert result["surprisal"][0] is None and len(result["surprisal"]) == length


@pytest.mark.parametrize("scheme", SCHEMES)
def test_first_layer_attention_is_the_models_own(
    server: Running, client: httpx.Client, scheme: str
) -> None:
    """Layer 0's weights, recomputed here from the model's parameters and its scheme's pieces."""
    result = trace(client, model=scheme)
    model = model_of(server, scheme)
    ids = torch.tensor([token["id"] for token in result["tokens"]])
    positions = torch.arange(len(ids)).unsqueeze(0)
    with torch.inference_mode():
        x = model.token_embedding(ids).unsqueeze(0)
        added = model.positional.embedding(positions)
        if added is not None:
            x = x + added
        block = model.blocks[0]
        qkv = block.attention.qkv(block.attention_norm(x))
        heads, head_dim = model.config.n_heads, model.config.head_dim
        queries, keys, _ = qkv.view(1, len(ids), 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        queries, keys = (
            model.positional.rotate(queries, positions),
            model.positional.rotate(keys, positions),
        )
        scores = queries @ keys.transpose(-2, -1) / math.sqrt(head_dim)
        bias = model.positional.attention_bias(positions, positions[0])
        if bias is not None:
            scores = scores + bias
        future = torch.ones(len(ids), len(ids), dtype=torch.bool).triu(1)
        expected = scores.masked_fill(future, float("-inf")).softmax(-1)[0]
    torch.testing.assert_close(torch.tensor(result["attention"][0]), expected, atol=1e-5, rtol=1e-4)


def test_alibi_bias_is_minus_slope_times_distance(server: Running, client: httpx.Client) -> None:
    result = trace(client, model="alibi")
    slopes = model_of(server, "alibi").positional.slopes.flatten().tolist()
    bias = result["position_bias"]
    length = len(result["tokens"])
    assert len(bias) == len(slopes) and result["rotation"] is None
    for head, slope in enumerate(slopes):
        for query in range(length):
            for key in range(length):
                value = bias[head][query][key]
                if key > query:
                    assert value is None  # masked: never added to a score
                else:
                    assert value == pytest.approx(-slope * (query - key), abs=1e-6)


def test_t5_bias_is_its_learned_bucket_values(server: Running, client: httpx.Client) -> None:
    model = model_of(server, "t5")
    params = model.positional.params
    result = trace(client, model="t5", prompt=LONG_PROMPT)  # past max_distance: shared buckets
    length = len(result["tokens"])
    assert length > params.max_distance
    table = model.positional.bias_table.detach()  # [buckets, heads]
    distance = torch.arange(length).unsqueeze(1) - torch.arange(length)
    buckets = relative_position_bucket(distance, params.num_buckets, params.max_distance)
    bias = result["position_bias"]
    causal = distance >= 0
    for head in range(model.config.n_heads):
        got = torch.tensor([[math.nan if v is None else v for v in row] for row in bias[head]])
        assert torch.isnan(got[~causal]).all()
        torch.testing.assert_close(got[causal], table[buckets, head][causal])
    # The nearest distances have a bucket each: the diagonal below the main one is row 1.
    assert bias[0][5][4] == pytest.approx(float(table[1, 0]))
    assert bias[0][length - 1][0] == pytest.approx(float(table[params.num_buckets - 1, 0]))


def test_rope_rotation_is_position_times_frequency(server: Running, client: httpx.Client) -> None:
    result = trace(client, model="rope", prompt=LONG_PROMPT)
    scheme = model_of(server, "rope").positional
    angles = torch.tensor(result["rotation"], dtype=torch.float64)
    half = scheme.rotary_dim // 2
    assert angles.shape == (len(result["tokens"]), half)
    frequencies = scheme.base ** (
        -torch.arange(0, scheme.rotary_dim, 2).double() / scheme.rotary_dim
    )
    expected = torch.arange(len(result["tokens"])).double().unsqueeze(1) * frequencies
    torch.testing.assert_close(angles, expected, atol=1e-4, rtol=1e-5)
    assert result["position_bias"] is None


@pytest.mark.parametrize("scheme", SCHEMES)
def test_embedding_norms_and_position_vectors(
    server: Running, client: httpx.Client, scheme: str
) -> None:
    result = trace(client, model=scheme)
    model = model_of(server, scheme)
    ids = torch.tensor([token["id"] for token in result["tokens"]])
    embedding = result["embedding"]
    with torch.inference_mode():
        token_norm = model.token_embedding(ids).norm(dim=-1)
        added = model.positional.embedding(torch.arange(len(ids)).unsqueeze(0))
    torch.testing.assert_close(torch.tensor(embedding["token_norm"]), token_norm)
    if scheme not in ADDITIVE:
        assert added is None
        assert embedding["position_vectors"] is None and embedding["position_norm"] is None
        return
    vectors = torch.tensor(embedding["position_vectors"])
    assert vectors.shape == (len(ids), model.config.d_model)
    torch.testing.assert_close(vectors, added[0].float())
    torch.testing.assert_close(torch.tensor(embedding["position_norm"]), vectors.norm(dim=-1))


FILTERS = {"temperature": 0.8, "top_k": 12, "top_p": 0.7, "min_p": 0.05, "repetition_penalty": 1.3}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_stages_sum_to_one_and_filter_as_documented(client: httpx.Client, scheme: str) -> None:
    vocab = 300
    result = trace(client, model=scheme, top=vocab, **FILTERS)
    stages = result["next_token"]["stages"]
    names = [s["name"] for s in stages]
    assert names == ["logits", "repetition_penalty", "temperature", "top_k", "top_p", "min_p"]
    for entry in stages:
        total = sum(probs_of(entry).values())
        assert total == pytest.approx(1, abs=1e-4), entry["name"]
        assert entry["kept"] == len(entry["top"])  # every non-zero token is listed
    assert stage(result, "top_k")["kept"] <= FILTERS["top_k"]
    # top-p keeps the smallest most-probable set whose mass (under top-k's output) reaches p.
    before = sorted(probs_of(stage(result, "top_k")).values(), reverse=True)
    kept = stage(result, "top_p")["kept"]
    assert sum(before[:kept]) >= FILTERS["top_p"] - 1e-6
    assert kept == 1 or sum(before[: kept - 1]) < FILTERS["top_p"]
    assert set(probs_of(stage(result, "top_p"))) == set(
        sorted(
            probs_of(stage(result, "top_k")), key=lambda t: -probs_of(stage(result, "top_k"))[t]
        )[:kept]
    )
    # min-p keeps the tokens with at least min_p × the top probability.
    after_p = probs_of(stage(result, "top_p"))
    threshold = FILTERS["min_p"] * max(after_p.values())
    assert set(probs_of(stage(result, "min_p"))) == {
        t for t, p in after_p.items() if p >= threshold
    }


def test_only_the_stages_that_apply_are_listed(client: httpx.Client) -> None:
    plain = trace(client, model="rope")
    assert [s["name"] for s in plain["next_token"]["stages"]] == ["logits", "temperature"]
    some = trace(client, model="rope", top_p=0.9, min_p=0.1)
    assert [s["name"] for s in some["next_token"]["stages"]] == [
        "logits",
        "temperature",
        "top_p",
        "min_p",
    ]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_logits_stage_equals_completion_top_logprobs(client: httpx.Client, scheme: str) -> None:
    result = trace(client, model=scheme, top=5, temperature=0.5, top_k=3)
    completion = client.post(
        "/v1/completions",
        json={
            "model": scheme,
            "prompt": PROMPT,
            "max_tokens": 1,
            "temperature": 1.0,
            "logprobs": 5,
            "return_tokens_as_token_ids": True,
        },
    ).json()
    top = completion["choices"][0]["logprobs"]["top_logprobs"][0]
    expected = {int(name.removeprefix("token_id:")): math.exp(lp) for name, lp in top.items()}
    got = probs_of(stage(result, "logits"))
    assert set(got) == set(expected)
    for token, prob in expected.items():
        assert got[token] == pytest.approx(prob, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize(
    ("scheme", "settings"),
    [
        ("rope", {"temperature": 1.5, "top_k": 6, "top_p": 0.8}),
        ("alibi", {"temperature": 1.2, "min_p": 0.2, "repetition_penalty": 1.5}),
    ],
)
def test_last_stage_is_what_completions_draw_from(
    client: httpx.Client, scheme: str, settings: dict[str, float]
) -> None:
    """Over many seeds the first token always lies in the last stage's support, with
    frequencies matching its probabilities (4 standard errors, 400 draws)."""
    result = trace(client, model=scheme, top=300, **settings)
    last = result["next_token"]["stages"][-1]
    support = probs_of(last)
    assert 1 < len(support) < 300
    draws = 400
    counts: Counter[int] = Counter()
    for seed in range(draws):
        completion = client.post(
            "/v1/completions",
            json={
                "model": scheme,
                "prompt": PROMPT,
                "max_tokens": 1,
                "seed": seed,
                "logprobs": 0,
                "return_tokens_as_token_ids": True,
                **settings,
            },
        ).json()
        name = completion["choices"][0]["logprobs"]["tokens"][0]
        counts[int(name.removeprefix("token_id:"))] += 1
    assert set(counts) <= set(support)
    for token, prob in support.items():
        error = math.sqrt(prob * (1 - prob) / draws)
        assert abs(counts[token] / draws - prob) <= 4 * error + 1e-9, (token, prob, counts)


def test_greedy_is_one_token_the_completion_takes(client: httpx.Client) -> None:
    result = trace(client, model="t5", temperature=0.0, repetition_penalty=2.0)
    assert result["next_token"]["greedy"]
    last = result["next_token"]["stages"][-1]
    assert last["name"] == "temperature" and last["kept"] == 1
    penalised = probs_of(stage(result, "repetition_penalty"))
    assert last["top"][0]["id"] == max(penalised, key=penalised.__getitem__)
    completion = client.post(
        "/v1/completions",
        json={
            "model": "t5",
            "prompt": PROMPT,
            "max_tokens": 1,
            "temperature": 0.0,
            "repetition_penalty": 2.0,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        },
    ).json()
    assert completion["choices"][0]["logprobs"]["tokens"][0] == f"token_id:{last['top'][0]['id']}"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_surprisal_equals_echo_scoring(client: httpx.Client, scheme: str) -> None:
    result = trace(client, model=scheme, prompt=LONG_PROMPT)
    scored = client.post(
        "/v1/completions",
        json={"model": scheme, "prompt": LONG_PROMPT, "echo": True, "max_tokens": 0, "logprobs": 0},
    ).json()
    logprobs = scored["choices"][0]["logprobs"]["token_logprobs"]
    assert result["surprisal"][0] is None and logprobs[0] is None
    expected = [lp / -math.log(2) for lp in logprobs[1:]]
    assert result["surprisal"][1:] == pytest.approx(expected, rel=1e-5, abs=1e-5)


def test_token_id_prompts_are_traced(client: httpx.Client) -> None:
    ids = client.post("/v1/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_ids = trace(client, prompt=ids[1:])  # encode_prompt adds <|bos|> to token ids too
    by_text = trace(client)
    assert by_ids["tokens"] == by_text["tokens"]
    assert by_ids["surprisal"] == by_text["surprisal"]


def error(client: httpx.Client, body: dict[str, Any], status: int = 400) -> dict[str, Any]:
    response = client.post("/v1/trace", json=body)
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_a_prompt_past_the_limit_is_a_400(client: httpx.Client) -> None:
    ids = client.post("/v1/tokenize", json={"prompt": "a"}).json()["tokens"]
    limit = min(MAX_TRACE_TOKENS, client.get("/v1/models").json()["data"][0]["max_context"])
    assert trace(client, prompt=[ids[-1]] * (limit - 1))["limit"] == limit
    found = error(client, {"prompt": [ids[-1]] * limit})
    assert found["code"] == "context_length_exceeded" and found["param"] == "prompt"
    assert str(limit) in found["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "temperature": 2.5}, "temperature"),
        ({"prompt": PROMPT, "temperature": True}, "temperature"),
        ({"prompt": PROMPT, "top_p": 0}, "top_p"),
        ({"prompt": PROMPT, "top_k": -1}, "top_k"),
        ({"prompt": PROMPT, "min_p": 1.5}, "min_p"),
        ({"prompt": PROMPT, "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": PROMPT, "top": 0}, "top"),
        ({"prompt": PROMPT, "max_tokens": 3}, "max_tokens"),  # not a trace field
        ({"prompt": [10**6]}, "prompt"),
        ({}, "prompt"),
    ],
)
def test_invalid_values_are_400s_naming_the_field(
    client: httpx.Client, body: dict[str, Any], param: str
) -> None:
    found = error(client, body)
    assert found["param"] == param and found["type"] == "invalid_request_error"
    if param in {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}:
        same = client.post("/v1/completions", json={**body, "max_tokens": 1}).json()["error"]
        assert same["message"] == found["message"]  # validated exactly like completions


def test_unknown_model_is_a_404(client: httpx.Client) -> None:
    assert error(client, {"prompt": PROMPT, "model": "gpt-5"}, 404)["code"] == "model_not_found"


def test_the_playground_and_its_assets_are_served(client: httpx.Client) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for asset in (
        "/static/app.js",
        "/static/style.css",
        "/static/vendor/d3.v7.9.2.min.js",
        "/static/vendor/plot.v0.6.17.umd.min.js",
    ):
        assert asset in page.text
        assert client.get(asset).status_code == 200, asset
    assert "http://" not in page.text.replace("http://www.w3.org", "")  # nothing from elsewhere


def test_the_schema_is_in_the_openapi_spec(client: httpx.Client) -> None:
    spec = client.get("/openapi.json").json()
    operation = spec["paths"]["/v1/trace"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "TraceRequest"
    )
    response = spec["components"]["schemas"]["TraceResponse"]["properties"]
    for field in (
        "tokens",
        "positions",
        "embedding",
        "attention",
        "position_bias",
        "rotation",
        "next_token",
        "surprisal",
    ):
        assert field in response
