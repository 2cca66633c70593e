"""OpenAI's request surface, through OpenAI's own client: n choices, a list of prompts,
logit_bias, frequency and presence penalties, top_logprobs up to 20 — each honoured — and every
other OpenAI field accepted as a no-op or refused with a 400 that says it is not supported."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from model.checkpoint import load_checkpoint
from model.generate import generate
from model.sampling import SamplingParams
from model.tokenizer import encode_prompt
from tests.server.conftest import Running
from tests.server.conftest import openai_client as client_of

SCENE = [{"role": "user", "content": "Good morrow."}]


def texts(answer: Any) -> list[str]:
    return [choice.text for choice in sorted(answer.choices, key=lambda c: c.index)]


def test_n_choices_are_each_the_request_seeded_with_seed_plus_j(server: Running) -> None:
    client = client_of(server)
    body: dict[str, Any] = {"model": "rope", "prompt": "To be", "max_tokens": 8, "temperature": 1.2}
    together = client.completions.create(**body, n=3, seed=40)
    assert [c.index for c in together.choices] == [0, 1, 2]
    alone = [client.completions.create(**body, seed=40 + j).choices[0].text for j in range(3)]
    assert texts(together) == alone
    assert together.usage is not None
    assert together.usage.prompt_tokens == client.completions.create(**body).usage.prompt_tokens  # type: ignore[union-attr]
    streamed = [""] * 3
    for chunk in client.completions.create(**body, n=3, seed=40, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == alone

    chat = client.chat.completions.create(
        model="rope",
        messages=SCENE,
        max_tokens=6,
        n=2,
        seed=7,  # type: ignore[arg-type]
    )
    single = client.chat.completions.create(
        model="rope",
        messages=SCENE,
        max_tokens=6,
        seed=8,  # type: ignore[arg-type]
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[1].message.content == single.choices[0].message.content


def test_a_list_of_prompts_gets_a_choice_each(server: Running) -> None:
    client = client_of(server)
    prompts = ["To be", "or not", "to be"]
    body: dict[str, Any] = {"model": "alibi", "max_tokens": 5, "seed": 3}
    together = client.completions.create(prompt=prompts, n=2, **body)
    assert len(together.choices) == 6
    for index, choice in enumerate(sorted(together.choices, key=lambda c: c.index)):
        prompt, j = prompts[index // 2], index % 2
        alone = client.completions.create(prompt=prompt, **{**body, "seed": 3 + j})
        assert choice.text == alone.choices[0].text, index
    ids = client.completions.create(prompt=[[5, 6], [7]], **body)
    assert len(ids.choices) == 2


def test_logit_bias_pushes_and_bans_tokens(server: Running, client: httpx.Client) -> None:
    oai = client_of(server)
    token = client.post("/v1/tokenize", json={"prompt": "e", "add_special_tokens": False}).json()
    (favourite,) = token["tokens"]
    forced = oai.completions.create(
        model="t5",
        prompt="To be",
        max_tokens=6,
        seed=1,
        logit_bias={str(favourite): 100},
        logprobs=1,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    assert forced.choices[0].logprobs.tokens == [f"token_id:{favourite}"] * 6  # type: ignore[union-attr]

    greedy: dict[str, Any] = {"model": "t5", "prompt": "To be", "max_tokens": 6, "temperature": 0}
    plain = oai.completions.create(
        **greedy, logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}
    )
    first = plain.choices[0].logprobs.tokens[0].removeprefix("token_id:")  # type: ignore[union-attr]
    banned = oai.completions.create(
        **greedy,
        logit_bias={first: -100},
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    assert f"token_id:{first}" not in banned.choices[0].logprobs.tokens  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "penalties",
    [
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2.0},
        {"frequency_penalty": -1.0, "presence_penalty": 0.5, "temperature": 0.0},
        {"frequency_penalty": 0.8, "repetition_penalty": 1.3, "top_k": 20},
    ],
)
def test_penalties_draw_what_offline_generate_draws(
    server: Running, checkpoints: Path, penalties: dict[str, float]
) -> None:
    """The server's batch (counts kept per row, rows joining and leaving) and offline
    generate() apply the penalties in the one place that samples: same tokens."""
    settings = {"temperature": 1.0, **penalties}
    answer = client_of(server).completions.create(
        model="lowrank",
        prompt="To be, or",
        max_tokens=20,
        seed=11,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **settings},
    )
    served = [int(t.removeprefix("token_id:")) for t in answer.choices[0].logprobs.tokens]  # type: ignore[union-attr]
    model, tokenizer = load_checkpoint(checkpoints / "lowrank", device="cpu")
    offline = generate(
        model,
        tokenizer,
        [encode_prompt(tokenizer, "To be, or")],
        max_new_tokens=20,
        sampling=SamplingParams(seed=11, **settings),  # type: ignore[arg-type]
        stop=[],
    )
    ids = offline[0].token_ids  # offline stops at <|eos|>; the server was told not to
    assert len(ids) >= 3 and served[: len(ids)] == ids


def test_top_logprobs_go_up_to_20(server: Running) -> None:
    reply = client_of(server).chat.completions.create(
        model="rope",
        messages=SCENE,
        max_tokens=2,
        logprobs=True,
        top_logprobs=20,  # type: ignore[arg-type]
    )
    assert all(len(e.top_logprobs) == 20 for e in reply.choices[0].logprobs.content)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {}),
        ("audio", {"voice": "alloy"}),
        ("store", True),
        ("reasoning_effort", "high"),
        ("modalities", ["text", "audio"]),
    ],
)
def test_an_unsupported_openai_field_is_a_400_saying_so(
    client: httpx.Client, field: str, value: Any
) -> None:
    response = client.post("/v1/chat/completions", json={"messages": SCENE, field: value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and "not supported by ordinal" in error["message"]


def test_no_op_values_of_unsupported_fields_are_accepted(client: httpx.Client) -> None:
    chat = {
        "messages": SCENE,
        "max_tokens": 2,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "store": False,
        "modalities": ["text"],
        "metadata": {"team": "ordinal"},
        "user": "u1",
        "frequency_penalty": 0,
        "presence_penalty": 0,
        "logit_bias": {},
    }
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    completion = {"prompt": "a", "max_tokens": 2, "best_of": 1, "suffix": None, "logit_bias": {}}
    assert client.post("/v1/completions", json=completion).status_code == 200


def test_detokenize_inverts_tokenize_and_models_have_their_own_route(
    client: httpx.Client,
) -> None:
    text = "Ça va, naïve café — ¿sí? 🎭"
    ids = client.post("/v1/tokenize", json={"prompt": text, "model": "rope"}).json()["tokens"]
    back = client.post("/v1/detokenize", json={"tokens": ids, "model": "rope"}).json()
    assert back == {"model": "rope", "prompt": text}  # <|bos|> has no text
    outside = client.post("/v1/detokenize", json={"tokens": [10**6]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"

    listed = {entry["id"]: entry for entry in client.get("/v1/models").json()["data"]}
    assert client.get("/v1/models/alibi").json() == listed["alibi"]
    missing = client.get("/v1/models/gpt-5")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert "max_context" in listed["alibi"]
    tokenized = client.post("/v1/tokenize", json={"prompt": "a", "model": "alibi"}).json()
    assert tokenized["max_context"] == listed["alibi"]["max_context"]  # one name for the limit
