"""lm-evaluation-harness's ``local-completions`` loglikelihood, as the harness asks it: the
context and the continuation as token ids it tokenized itself, ``echo`` with ``max_tokens`` 1,
and the sum of ``token_logprobs[ctxlen:-1]``. Token ids are used as given, so that sum is the
continuation's log-likelihood exactly as ``ordinal eval`` scores the same text."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from model.checkpoint import load_checkpoint
from model.data import IGNORE_INDEX
from model.evaluate import token_losses
from model.tokenizer import special_ids

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
