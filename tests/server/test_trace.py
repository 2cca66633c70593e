"""``POST /v1/trace`` against the tiny checkpoints of every scheme: the attention, positional and
next-token pieces are checked against the model's own tensors and against what
``/v1/completions`` scores and samples. Also the geometry report routes the Encodings view reads.

The attention weights, biases and positional vectors come rounded to 4 significant digits (a
relative error of at most 5e-4: ROUNDED below), attention and bias as causal lower triangles."""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import torch

from model.checkpoint import load_checkpoint
from model.positional import SCHEMES
from model.positional.t5 import relative_position_bucket
from model.transformer import Transformer
from server.api.playground import GEOMETRY_REPORTS, STATIC
from server.api.schemas import MAX_TRACE_TOKENS
from server.engine.trace import round_significant
from tests.server.conftest import Running
from tests.test_shipped_checkpoints import SHIPPED_MODELS

# Kinds without an encoding per position: the geometry report has no row of theirs.
TEXTUAL = ("data-dependent", "weights")

PROMPT = "To be, or not to be, that is the question"
# About 45 tokens: past t5's max_distance (24), within the table schemes' 64 positions.
LONG_PROMPT = "All the world's a stage, and all the men and women merely players. All the world's"
ADDITIVE = ("integer", "binary", "sinusoidal", "learned", "mds", "lowrank")
ROUNDED = {"rtol": 5e-4, "atol": 1e-6}  # 4 significant digits: half a unit in the 4th digit
# The playground's modules import each other by relative path: `import { a } from "./b.js";`.
MODULE_IMPORT = re.compile(r'^import [^;]* from "\./([\w-]+\.js)";$', re.MULTILINE)


def trace(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/trace", json={"prompt": PROMPT, **body})
    assert response.status_code == 200, response.text
    return response.json()


@functools.cache
def _load(folder: Path) -> Transformer:
    return load_checkpoint(folder, device="cpu").model


def model_of(server: Running, name: str) -> Transformer:
    """The served model's weights, loaded here from its checkpoint (the engine process holds
    the served copy)."""
    return _load(server.service.settings.checkpoints / name)


def stage(result: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in result["next_token"]["stages"] if s["name"] == name)


def probs_of(stage: dict[str, Any]) -> dict[int, float]:
    return {entry["id"]: entry["prob"] for entry in stage["top"]}


def square(triangle: list[Any], fill: float = 0.0) -> torch.Tensor:
    """Causal lower triangles [...][T][q+1] → a tensor [..., T, T], ``fill`` after the diagonal.
    Checks that row q has exactly q + 1 entries."""
    if triangle and isinstance(triangle[0][0], list):
        return torch.stack([square(part, fill) for part in triangle])
    length = len(triangle)
    assert [len(row) for row in triangle] == list(range(1, length + 1))
    out = torch.full((length, length), fill)
    for query, row in enumerate(triangle):
        out[query, : query + 1] = torch.tensor(row)
    return out


def inputs_of(model: Transformer, result: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """The traced prompt's ids [T], positions [1, T], token vectors [1, T, d] and the positional
    vectors the scheme adds ([1, T, d], or None), from the model's own modules."""
    ids = torch.tensor([token["id"] for token in result["tokens"]])
    positions = torch.arange(len(ids)).unsqueeze(0)
    with torch.inference_mode():
        tokens = model.token_embedding(ids).unsqueeze(0)
        added = model.positional.embedding(positions)
    return ids, positions, tokens, added


def first_token(client: httpx.Client, model: str, **fields: Any) -> dict[str, Any]:
    """A one-token completion of PROMPT with token-id logprobs; ``fields`` add or override."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "logprobs": 0}
    response = client.post(
        "/v1/completions", json={**body, "return_tokens_as_token_ids": True, **fields}
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]


def token_id(name: str) -> int:
    return int(name.removeprefix("token_id:"))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_attention_rows_are_causal_and_sum_to_one(client: httpx.Client, scheme: str) -> None:
    result = trace(client, model=scheme)
    ids = client.post("/v1/tokenize", json={"model": scheme, "prompt": PROMPT}).json()["tokens"]
    assert [token["id"] for token in result["tokens"]] == ids
    length = len(ids)
    assert result["positions"] == list(range(length))
    attention = square(result["attention"])  # row q holds keys 0..q: causal by its shape
    assert attention.shape == (result["n_layers"], result["n_heads"], length, length)
    assert (attention >= 0).all()
    sums = attention.sum(-1)
    if SCHEMES[scheme].replaces_softmax:  # stick-breaking: what is left goes nowhere
        assert (sums <= 1 + 1e-3).all() and (sums < 0.99).any()
    else:
        torch.testing.assert_close(sums, torch.ones(attention.shape[:-1]), atol=1e-3, rtol=0)
    assert result["surprisal"][0] is None and len(result["surprisal"]) == length


@pytest.mark.parametrize("scheme", SCHEMES)
def test_first_layer_attention_is_the_models_own(
    server: Running, client: httpx.Client, scheme: str
) -> None:
    """Layer 0's weights, recomputed here from the model's parameters and its scheme's pieces."""
    result = trace(client, model=scheme)
    model = model_of(server, scheme)
    ids, positions, x, added = inputs_of(model, result)
    with torch.inference_mode():
        if added is not None:
            x = x + added
        block = model.blocks[0]
        qkv = block.attention.qkv(block.attention_norm(x))
        heads, head_dim = model.config.n_heads, model.config.head_dim
        queries, keys, _ = qkv.view(1, len(ids), 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        rotation = model.positional.rotation(positions)
        if rotation is not None:  # queries and keys turned together, as attention does
            joined = torch.cat([queries, keys], dim=1)
            turned = model.positional.turn(joined, rotation, heads, 0)
            queries, keys = turned.split([heads, heads], dim=1)
        # SDPA's scale: 1/√ of the turned width (PoPE's is twice a head's)
        scores = queries @ keys.transpose(-2, -1) / math.sqrt(queries.shape[-1])
        bias = model.positional.attention_bias(positions, positions[0])
        if bias is not None:
            scores = scores + bias
        future = torch.ones(len(ids), len(ids), dtype=torch.bool).triu(1)
        scheme = model.positional
        if scheme.data_dependent:  # fox, cope, path: the bias of the layer's own inputs
            hidden = block.attention_norm(x)
            inside = scheme.layer_bias(0, queries, keys, scheme.key_state(0, hidden), ~future)
            moved = None
            if scheme.rewrites_keys:  # PaTH: what the transitions between key and query did
                before = torch.ones_like(future).tril(-1)[None, None]
                moved = scheme.move_keys(0, hidden, queries, keys, before, None)
            assert inside is not None or moved is not None
            scores = scores + sum(part.bias for part in (inside, moved) if part is not None)
        # softmax, or the weights a scheme puts in its place (stick-breaking's)
        expected = model.positional.attention_weights(scores, ~future[None, None])[0]
    torch.testing.assert_close(square(result["attention"][0]), expected, **ROUNDED)


def test_alibi_bias_is_minus_slope_times_distance(server: Running, client: httpx.Client) -> None:
    result = trace(client, model="alibi")
    slopes = model_of(server, "alibi").positional.slopes.flatten().tolist()
    bias = result["position_bias"]
    length = len(result["tokens"])
    assert len(bias) == len(slopes) and result["rotation"] is None
    for head, slope in enumerate(slopes):
        assert [len(row) for row in bias[head]] == list(range(1, length + 1))  # keys 0..q
        for query in range(length):
            for key in range(query + 1):
                expected = -slope * (query - key)
                assert bias[head][query][key] == pytest.approx(expected, rel=5e-4, abs=1e-6)


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
        got = square(bias[head], math.nan)
        torch.testing.assert_close(got[causal], table[buckets, head][causal], **ROUNDED)
    # The nearest distances have a bucket each: the diagonal below the main one is row 1.
    assert bias[0][5][4] == pytest.approx(float(table[1, 0]), rel=5e-4)
    assert bias[0][length - 1][0] == pytest.approx(
        float(table[params.num_buckets - 1, 0]), rel=5e-4
    )


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


def test_fox_gates_are_the_sigmoid_of_the_gate_projection_and_sum_into_the_bias(
    server: Running, client: httpx.Client
) -> None:
    """Layer 0's f_t = σ(w·x_t + b), recomputed here from its normalised input; in every layer,
    the bias of query q for key k is the sum of log f over the tokens k+1..q."""
    result = trace(client, model="fox")
    model = model_of(server, "fox")
    ids, _, x, _ = inputs_of(model, result)
    gates = torch.tensor(result["forget_gates"])  # [L, H, T]
    assert gates.shape == (model.config.n_layers, model.config.n_heads, len(ids))
    assert result["position_bias"] is None and result["contextual_positions"] is None
    scheme = model.positional
    with torch.inference_mode():
        hidden = model.blocks[0].attention_norm(x)[0]  # [T, d]
        logits = hidden @ scheme.gate_weight[0].T + scheme.gate_bias[0]  # [T, H]
    torch.testing.assert_close(gates[0], torch.sigmoid(logits).T, atol=1e-6, rtol=1e-5)
    for layer, triangle in enumerate(result["layer_bias"]):
        bias, log_gates = square(triangle).double(), gates[layer].log().double()  # [H, T(, T)]
        for query in (0, 3, len(ids) - 1):
            for key in range(query + 1):
                expected = log_gates[:, key + 1 : query + 1].sum(-1)
                torch.testing.assert_close(bias[:, query, key], expected, rtol=5e-4, atol=1e-5)


def test_cope_positions_sum_the_gates_of_the_keys_from_each_key_to_the_query(
    server: Running, client: httpx.Client
) -> None:
    result = trace(client, model="cope")
    model = model_of(server, "cope")
    ids, _, x, _ = inputs_of(model, result)
    positions = square(result["contextual_positions"][0])  # layer 0: [H, T, T]
    assert result["forget_gates"] is None and result["position_bias"] is None
    assert len(result["layer_bias"]) == model.config.n_layers
    with torch.inference_mode():
        block = model.blocks[0]
        qkv = block.attention.qkv(block.attention_norm(x))
        heads, head_dim = model.config.n_heads, model.config.head_dim
        queries, keys, _ = qkv.view(1, len(ids), 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        gates = torch.sigmoid(queries[0] @ keys[0].transpose(-2, -1) / math.sqrt(head_dim))
    for query in range(len(ids)):
        for key in range(query + 1):
            expected = gates[:, query, key : query + 1].sum(-1)
            torch.testing.assert_close(positions[:, query, key], expected, **ROUNDED)


def test_fire_bias_is_its_mlp_of_the_interpolated_distance(
    server: Running, client: httpx.Client
) -> None:
    result = trace(client, model="fire", prompt=LONG_PROMPT)
    scheme = model_of(server, "fire").positional
    length = len(result["tokens"])
    assert result["layer_bias"] is None and result["rotation"] is None
    distance = torch.arange(length).unsqueeze(1) - torch.arange(length)
    with torch.inference_mode():
        inputs = scheme.interpolated_distance(
            torch.arange(length).unsqueeze(0), torch.arange(length)
        )
        expected = scheme.mlp_out(torch.relu(scheme.mlp_in(inputs.unsqueeze(-1))))[0]  # [T, T, H]
    bias = result["position_bias"]
    for head in range(scheme.config.n_heads):
        got = square(bias[head], math.nan)
        torch.testing.assert_close(
            got[distance >= 0], expected[..., head][distance >= 0], **ROUNDED
        )


@pytest.mark.parametrize("scheme", SCHEMES)
def test_embedding_norms_and_position_vectors(
    server: Running, client: httpx.Client, scheme: str
) -> None:
    result = trace(client, model=scheme)
    _, _, tokens, added = inputs_of(model_of(server, scheme), result)
    embedding = result["embedding"]
    torch.testing.assert_close(torch.tensor(embedding["token_norm"]), tokens[0].norm(dim=-1))
    if scheme not in ADDITIVE:
        assert added is None
        assert embedding["position_vectors"] is None and embedding["position_norm"] is None
        return
    vectors = torch.tensor(embedding["position_vectors"])
    assert vectors.shape == added[0].shape
    torch.testing.assert_close(vectors, added[0].float(), **ROUNDED)
    torch.testing.assert_close(torch.tensor(embedding["position_norm"]), added[0].norm(dim=-1))


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
    top = first_token(client, scheme, temperature=1.0, logprobs=5)["top_logprobs"][0]
    expected = {token_id(name): math.exp(lp) for name, lp in top.items()}
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
        counts[token_id(first_token(client, scheme, seed=seed, **settings)["tokens"][0])] += 1
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
    greedy = first_token(client, "t5", temperature=0.0, repetition_penalty=2.0)
    assert greedy["tokens"][0] == f"token_id:{last['top'][0]['id']}"


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
    by_ids = trace(client, prompt=ids)  # token ids are used as given, <|bos|> and all
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
    # token ids are used as given (no <|bos|> added): exactly the limit fits
    assert trace(client, prompt=[ids[-1]] * limit)["limit"] == limit
    found = error(client, {"prompt": [ids[-1]] * (limit + 1)})
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
        ({"prompt": PROMPT, "logit_bias": {"938206652": -48.7}}, "logit_bias"),  # past the vocab
        ({}, "prompt"),
    ],
)
def test_invalid_values_are_400s_naming_the_field(
    client: httpx.Client, body: dict[str, Any], param: str
) -> None:
    found = error(client, body)
    assert found["param"] == param and found["type"] == "invalid_request_error"
    if param in {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "logit_bias"}:
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
    # The entry module's imports, followed: each module is served as JavaScript (a browser runs
    # a module script of no other type), from this server, and every one in the folder is used.
    served, queue = set(), ["app.js"]
    while queue:
        name = queue.pop()
        if name not in served:
            served.add(name)
            module = client.get(f"/static/{name}")
            assert module.status_code == 200, name
            assert "javascript" in module.headers["content-type"], name
            queue.extend(MODULE_IMPORT.findall(module.text))
    assert served == {path.name for path in STATIC.glob("*.js")}


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
        "layer_bias",
        "forget_gates",
        "contextual_positions",
        "rotation",
        "next_token",
        "surprisal",
    ):
        assert field in response


def significant_digits(value: float) -> int:
    """How many significant digits the shortest form of ``value`` has."""
    mantissa = f"{abs(value):.10e}".split("e")[0].replace(".", "").rstrip("0")
    return max(len(mantissa), 1)


def test_round_significant() -> None:
    values = np.array([0.0, 1.0, 0.123456, -98765.4, 1.23456e-7, 0.99996, np.nan])
    got = round_significant(values)
    assert got.dtype == np.float32
    expected = [0.0, 1.0, 0.1235, -98770.0, 1.235e-7, 1.0, np.nan]
    np.testing.assert_allclose(got, np.array(expected, dtype=np.float32), rtol=1e-7)
    written = orjson.loads(orjson.dumps(got, option=orjson.OPT_SERIALIZE_NUMPY))  # as served
    assert [significant_digits(v) for v in written[:-1]] == [1, 1, 4, 4, 4, 1]
    assert written[-1] is None


def test_the_large_fields_are_rounded_and_the_small_ones_exact(client: httpx.Client) -> None:
    response = client.post("/v1/trace", json={"model": "alibi", "prompt": LONG_PROMPT})
    result = response.json()
    numbers = [v for layer in result["attention"] for head in layer for row in head for v in row]
    numbers += [v for head in result["position_bias"] for row in head for v in row]
    assert max(significant_digits(v) for v in numbers) == 4
    learned = trace(client, model="learned")["embedding"]
    assert max(significant_digits(v) for row in learned["position_vectors"] for v in row) == 4
    assert max(significant_digits(v) for v in learned["token_norm"]) > 4  # float32, unrounded
    # Without the attention weights the response is small: the page's positional views ask so.
    small = client.post(
        "/v1/trace", json={"model": "alibi", "prompt": LONG_PROMPT, "attention": False}
    )
    assert small.json()["attention"] is None
    assert small.json()["position_bias"] == result["position_bias"]
    assert len(small.content) < len(response.content) / 2


# ---- the geometry reports (the Encodings view) ----------------------------------------------

CORPORA = sorted(path.parent.name for path in GEOMETRY_REPORTS.glob("*/report.json"))


def test_geometry_lists_the_committed_reports(client: httpx.Client) -> None:
    assert CORPORA == ["shakespeare", "synthetic"]
    listed = client.get("/v1/geometry").json()
    assert [entry["corpus"] for entry in listed["data"]] == CORPORA
    for entry in listed["data"]:
        report = orjson.loads((GEOMETRY_REPORTS / entry["corpus"] / "report.json").read_bytes())
        assert entry["schemes"] == [row["label"] for row in report["schemes"]]
        assert entry["figures"] == report["figures"]
        assert entry["n_positions"] == report["corpus"]["n_positions"]


@pytest.mark.parametrize("corpus", CORPORA)
def test_geometry_serves_the_report_and_its_figures(client: httpx.Client, corpus: str) -> None:
    folder: Path = GEOMETRY_REPORTS / corpus
    response = client.get(f"/v1/geometry/{corpus}")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.content == (folder / "report.json").read_bytes()  # byte for byte
    report = response.json()
    # synthetic measures every scheme untrained; shakespeare, the shipped checkpoints with an
    # encoding per position (fox's, cope's and path's depend on the text, stick-breaking's is
    # its process over the keys)
    by_position = {name for name in SHIPPED_MODELS.values() if SCHEMES[name].kind not in TEXTUAL}
    expected = set(SCHEMES) if corpus == "synthetic" else by_position
    assert {row["scheme"] for row in report["requirements"]} == expected
    if corpus == "shakespeare":
        assert "prope (rope)" in {row["label"] for row in report["requirements"]}
    for figure in report["figures"]:
        png = client.get(f"/v1/geometry/{corpus}/{figure}")
        assert png.status_code == 200 and png.headers["content-type"] == "image/png"
        assert png.content == (folder / figure).read_bytes()


@pytest.mark.parametrize(
    ("path", "param", "code"),
    [
        ("/v1/geometry/wikipedia", "corpus", "report_not_found"),
        ("/v1/geometry/wikipedia/hellinger.png", "corpus", "report_not_found"),
        ("/v1/geometry/synthetic/report.md", "figure", "figure_not_found"),
        ("/v1/geometry/synthetic/report.json", "figure", "figure_not_found"),
        # An encoded slash decodes to "/": no route matches, nothing outside is reachable.
        ("/v1/geometry/synthetic/..%2F..%2FREADME.md", None, None),
        ("/v1/geometry/..%2Fplayground/generate.png", None, None),
    ],
)
def test_geometry_answers_only_what_a_report_names(
    client: httpx.Client, path: str, param: str | None, code: str | None
) -> None:
    response = client.get(path)
    assert response.status_code == 404, response.text
    found = response.json()["error"]
    assert (found["param"], found["code"], found["type"]) == (
        param,
        code,
        "invalid_request_error",
    )


def test_geometry_is_in_the_openapi_spec(client: httpx.Client) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/v1/geometry", "/v1/geometry/{corpus}", "/v1/geometry/{corpus}/{figure}"):
        responses = paths[path]["get"]["responses"]
        assert "200" in responses and "401" in responses, path
        if "{" in path:
            assert responses["404"]["content"]["application/json"]["schema"]["$ref"].endswith(
                "ErrorBody"
            )


SHIPPED = Path(__file__).resolve().parents[2] / "checkpoints"


@pytest.fixture(scope="module")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The shipped checkpoints, served as users get them."""
    from tests.server.conftest import running_server, test_settings

    with running_server(test_settings(SHIPPED)) as running:
        yield running


def test_the_server_lists_every_shipped_model_by_default(shipped: Running) -> None:
    """No --models: every checkpoint folder is served and listed (issue #25: the ten of the card,
    fox, cope, fire, prope and drope; issue #53: the third round's)."""
    with httpx.Client(base_url=shipped.url, timeout=60) as client:
        listed = {entry["id"]: entry for entry in client.get("/v1/models").json()["data"]}
    folders = {path.parent.name for path in SHIPPED.glob("*/config.json")}
    assert set(listed) == set(SHIPPED_MODELS) == folders and len(listed) >= 15
    assert {name: entry["scheme"] for name, entry in listed.items()} == SHIPPED_MODELS


@pytest.mark.parametrize("scheme", SHIPPED_MODELS)
def test_the_shipped_models_trace_causal_attention_and_normalised_stages(
    shipped: Running, scheme: str
) -> None:
    with httpx.Client(base_url=shipped.url, timeout=60) as client:
        result = trace(client, model=scheme, top=2048, temperature=0.8, top_k=40, top_p=0.9)
        attention = square(result["attention"])
        sums = attention.sum(-1)
        if SCHEMES[SHIPPED_MODELS[scheme]].replaces_softmax:  # stick-breaking: at most 1
            assert (sums <= 1 + 1e-3).all()
        else:
            torch.testing.assert_close(sums, torch.ones(attention.shape[:-1]), atol=1e-3, rtol=0)
        for entry in result["next_token"]["stages"]:
            assert sum(probs_of(entry).values()) == pytest.approx(1, abs=1e-4), entry["name"]
        assert stage(result, "top_k")["kept"] <= 40
        echo = client.post(
            "/v1/completions",
            json={"model": scheme, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0},
        ).json()["choices"][0]["logprobs"]["token_logprobs"]
        expected = [-value / math.log(2) for value in echo[1:]]
        assert result["surprisal"][1:] == pytest.approx(expected, abs=1e-3)
        if scheme == "alibi":
            slopes = model_of(shipped, "alibi").positional.slopes.flatten()
            bias = square(result["position_bias"])
            distance = torch.arange(bias.shape[-1])
            expected_bias = -slopes[:, None, None] * (distance[:, None] - distance[None, :])
            lower = torch.ones_like(bias[0], dtype=torch.bool).tril()
            torch.testing.assert_close(
                bias[:, lower], expected_bias[:, lower], rtol=5e-4, atol=1e-5
            )
