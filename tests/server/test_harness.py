"""lm-evaluation-harness's ``local-completions`` loglikelihood, as the harness asks it: the
context and the continuation as token ids it tokenized itself, ``echo`` with ``max_tokens`` 1,
and the sum of ``token_logprobs[ctxlen:-1]``. Token ids are used as given, so that sum is the
continuation's log-likelihood exactly as ``ordinal eval`` scores the same text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from lab.data import IGNORE_INDEX
from lab.evaluate import token_losses
from model.checkpoint import load_checkpoint
from model.tokenizer import special_ids
from tests.server.conftest import Running

CONTEXT = "To be, or not to be,"
CONTINUATION = " that is the question"


@pytest.mark.parametrize("scheme", ["rope", "alibi", "learned"])
def test_harness_loglikelihood_equals_ordinal_eval(
    client: httpx.Client, checkpoints: Path, scheme: str
) -> None:
    model, tokenizer = load_checkpoint(checkpoints / scheme, device="cpu")
    context = [special_ids(tokenizer).bos, *tokenizer.encode(CONTEXT).ids]
    continuation = tokenizer.encode(CONTINUATION).ids
    ids = context + continuation
    response = client.post(
        "/v1/completions",
        json={
            "model": scheme,
            "prompt": ids,
            "echo": True,
            "max_tokens": 1,
            "logprobs": 1,
            "temperature": 0,
            "return_tokens_as_token_ids": True,
        },
    )
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    # echo returns exactly the tokens sent, then the one generated: nothing prepended
    assert logprobs["tokens"][: len(ids)] == [f"token_id:{token}" for token in ids]
    assert len(logprobs["tokens"]) == len(ids) + 1
    harness = sum(logprobs["token_logprobs"][len(context) : -1])

    # ordinal eval's per-token losses of the same sequence, its continuation's targets only
    inputs, targets = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
    targets[0, : len(context) - 1] = IGNORE_INDEX
    offline = -float(token_losses(model, inputs, targets).sum())
    assert harness == pytest.approx(offline, abs=1e-3)


def test_token_ids_without_bos_are_not_given_one(client: httpx.Client) -> None:
    ids = client.post("/v1/tokenize", json={"prompt": CONTEXT, "add_special_tokens": False})
    tokens = ids.json()["tokens"]
    body = {"prompt": tokens, "echo": True, "max_tokens": 0, "logprobs": 0}
    answer = client.post("/v1/completions", json={**body, "return_tokens_as_token_ids": True})
    choice = answer.json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{token}" for token in tokens]
    assert choice["text"] == CONTEXT
    assert answer.json()["usage"]["prompt_tokens"] == len(tokens)


def test_an_empty_list_of_token_ids_is_a_400(client: httpx.Client) -> None:
    answer = client.post("/v1/completions", json={"prompt": [], "max_tokens": 1})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "prompt"


# ---- lm-evaluation-harness's default tokenizer: the server's own, over HTTP ------------------
# ``local-completions`` with no tokenizer argument (``tokenizer_backend`` auto or remote) finds
# the tokenizer at the server's root as vLLM serves it (its ``lm_eval.utils.RemoteTokenizer``);
# before ``/tokenize`` existed there it fell back to downloading a tokenizer named after the
# model. Each call below is one the harness makes, with its body.


def harness_encode(client: httpx.Client, text: str) -> list[int]:
    """``RemoteTokenizer.encode``."""
    answer = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert answer.status_code == 200, answer.text
    return answer.json()["tokens"]


def harness_loglikelihood(
    client: httpx.Client, context: list[int], continuation: list[int]
) -> float:
    """``LocalCompletionsAPI``'s request and ``parse_logprobs``: echo the ids with
    ``max_tokens`` 1, sum ``token_logprobs[ctxlen:-1]``."""
    body = {"prompt": [context + continuation], "temperature": 0, "max_tokens": 1}
    body |= {"logprobs": 1, "seed": 1234, "echo": True, "model": "rope"}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    return sum(answer.json()["choices"][0]["logprobs"]["token_logprobs"][len(context) : -1])


def test_harness_remote_tokenizer_scores_as_ordinals_echo(
    client: httpx.Client, server: Running
) -> None:
    # check_remote_tokenizer_support: /tokenizer_info names an eos token, /tokenize answers
    info = client.get("/tokenizer_info").json()
    assert "eos_token" in info
    probe = client.post("/tokenize", json={"prompt": "test", "add_special_tokens": False})
    assert probe.status_code == 200 and isinstance(probe.json()["tokens"], list)

    # bos_token_id: the first id of the bos token's name (the prefix of an empty context)
    served = server.service.models["rope"]
    assert harness_encode(client, info["bos_token"]) == [served.bos]
    assert harness_encode(client, info["eos_token"]) == [served.eos]

    # an empty context (loglikelihood_rolling, perplexity tasks): the prefix token + the text's
    # ids, the log-likelihood ordinal's echo scoring gives the text itself. The harness (0.4.13)
    # takes ``bos_token_id or eos_token_id`` as the prefix, which reads <|bos|>'s id 0 as none
    # and prefixes <|eos|>: README's ``custom_prefix_token_id=0`` sets it right.
    assert served.bos == 0
    custom_prefix_token_id = 0
    text = CONTEXT + CONTINUATION
    harness = harness_loglikelihood(client, [custom_prefix_token_id], harness_encode(client, text))
    body = {"model": "rope", "prompt": text, "echo": True, "max_tokens": 0, "logprobs": 0}
    echo = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert echo["token_logprobs"][0] is None  # <|bos|>, which nothing predicts
    assert harness == pytest.approx(sum(echo["token_logprobs"][1:]), abs=1e-4)

    # a context and a continuation (_encode_pair): the ids are what /v1/tokenize gives
    whole = harness_encode(client, CONTEXT + CONTINUATION)
    context = harness_encode(client, CONTEXT)
    bare = {"model": "rope", "prompt": CONTEXT + CONTINUATION, "add_special_tokens": False}
    assert whole == client.post("/v1/tokenize", json=bare).json()["tokens"]
    pair = harness_loglikelihood(client, context, whole[len(context) :])
    body = {"model": "rope", "prompt": whole, "echo": True, "max_tokens": 0, "logprobs": 0}
    echo = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert pair == pytest.approx(sum(echo["token_logprobs"][len(context) :]), abs=1e-4)

    # decode (RemoteTokenizer.decode) gives the text back
    answer = client.post("/detokenize", json={"tokens": whole})
    assert answer.json() == {"prompt": CONTEXT + CONTINUATION}


def test_root_tokenize_has_vllms_shape(client: httpx.Client, server: Running) -> None:
    served = server.service.models["rope"]
    text = "Fair is foul<|eos|> 🎭"
    answer = client.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert set(answer) == {"count", "max_model_len", "tokens", "token_strs"}
    head, _, tail = text.partition("<|eos|>")
    v1 = [
        client.post("/v1/tokenize", json={"prompt": t, "add_special_tokens": False}).json()[
            "tokens"
        ]
        for t in (head, tail)
    ]
    assert answer["tokens"] == [served.bos, *v1[0], served.eos, *v1[1]]
    assert (
        answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == served.max_context
    )
    assert answer["token_strs"] == [served.tokenizer.id_to_token(t) for t in answer["tokens"]]
    assert client.post("/tokenize", json={"prompt": "a"}).json()["token_strs"] is None
    # a completion's text prompt still encodes the name as bytes: /v1/tokenize says so
    v1_whole = client.post("/v1/tokenize", json={"prompt": text}).json()["tokens"]
    assert served.eos not in v1_whole


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, 400, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "return_token_strs": [1]}, 400, "return_token_strs"),
        ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "model"),
        ("/tokenize", {"prompt": "a", "stream": True}, 400, "stream"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "nope"}, 404, "model"),
    ],
)
def test_root_tokenize_and_detokenize_name_the_bad_field(
    client: httpx.Client, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    answer = client.post(path, json=body)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param
