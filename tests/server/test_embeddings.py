"""``POST /v1/embeddings`` through OpenAI's own client against a real server: each vector is the
served model's hidden state from an in-process forward pass of the same checkpoint (within 1e-5),
at the layer and pooling asked for, in either encoding; inputs as text or token ids give the
same vectors; usage counts the tokens; bad input is a 400 naming the field."""

from __future__ import annotations

import base64
import functools
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch

from model.checkpoint import load_checkpoint
from model.tokenizer import encode_prompt
from model.transformer import AttentionRecorder, Transformer
from tests.server.conftest import Running
from tests.server.conftest import openai_client as client_of

TEXTS = ["Now is the winter of our discontent", "To be, or not to be", "a"]
TOLERANCE = 1e-5


@functools.cache
def loaded(folder: Path) -> Transformer:
    return load_checkpoint(folder).model


def hidden_states(folder: Path, ids: list[int]) -> list[torch.Tensor]:
    """[T, d] per residual stream, in-process: the embeddings entering block 0, each block's
    output, and the final norm's output (checked against the logits it gives)."""
    model = loaded(folder)
    tokens = torch.tensor([ids])
    with torch.inference_mode():
        positions = torch.arange(len(ids)).unsqueeze(0)
        recorder = AttentionRecorder(weights=False)
        logits = model.traced_forward(tokens, recorder)
        final = model.final_norm(recorder.residuals[-1])
        assert torch.allclose(model.lm_head(final), logits, atol=1e-5)  # what logits read
        assert torch.allclose(model(tokens), logits, atol=1e-4)  # the served forward's
        return [state[0] for state in [model.embed(tokens, positions), *recorder.residuals, final]]


def prompt_ids(server: Running, text: str) -> list[int]:
    return encode_prompt(server.service.models["rope"].tokenizer, text)


@pytest.mark.parametrize("model", ["rope", "learned", "fox"])
def test_the_sdks_vectors_are_the_models_hidden_state(
    server: Running, checkpoints: Path, model: str
) -> None:
    client = client_of(server)
    for layer, pooling in [(None, "mean"), (None, "last"), (0, "mean"), (1, "last"), (2, "mean")]:
        extra = {"pooling": pooling} | ({} if layer is None else {"layer": layer})
        answer = client.embeddings.create(model=model, input=TEXTS, extra_body=extra)
        assert answer.model == model and [item.index for item in answer.data] == [0, 1, 2]
        for text, item in zip(TEXTS, answer.data, strict=True):
            states = hidden_states(checkpoints / model, prompt_ids(server, text))
            state = states[-1 if layer is None else layer]
            expected = state.mean(dim=0) if pooling == "mean" else state[-1]
            assert len(item.embedding) == expected.shape[0] == 32
            got = torch.tensor(item.embedding)
            assert torch.allclose(got, expected, rtol=0, atol=TOLERANCE), (layer, pooling)
        sizes = [len(prompt_ids(server, text)) for text in TEXTS]
        assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(sizes)


def float32(answer: Any) -> np.ndarray:
    """The vectors of an embeddings answer as float32 (JSON's shortest float32 digits and the
    base64 bytes are the same numbers there)."""
    return np.array([item.embedding for item in answer.data], dtype=np.float32)


def test_base64_and_float_and_token_ids_give_the_same_vectors(server: Running) -> None:
    client = client_of(server)
    floats = client.embeddings.create(model="rope", input=TEXTS, encoding_format="float")
    by_default = client.embeddings.create(model="rope", input=TEXTS)  # the SDK asks for base64
    assert np.array_equal(float32(by_default), float32(floats))
    ids = [prompt_ids(server, text) for text in TEXTS]
    as_ids = client.embeddings.create(model="rope", input=ids, encoding_format="float")
    assert np.array_equal(float32(as_ids), float32(floats))
    one = client.embeddings.create(model="rope", input=ids[1], encoding_format="float")
    assert np.array_equal(float32(one)[0], float32(floats)[1])
    raw = httpx.post(
        f"{server.url}/v1/embeddings",
        json={"model": "rope", "input": TEXTS[0], "encoding_format": "base64"},
    ).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(vector, float32(floats)[0])
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding"


def test_the_last_layer_before_the_final_norm_is_not_the_default(server: Running) -> None:
    client = client_of(server)
    default = client.embeddings.create(model="rope", input="a", encoding_format="float")
    last_block = client.embeddings.create(
        model="rope", input="a", encoding_format="float", extra_body={"layer": 2}
    )
    assert default.data[0].embedding != last_block.data[0].embedding


GOOD: dict[str, Any] = {"model": "rope", "input": "To be"}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"layer": 3}, "layer"),  # the tiny models have 2 blocks: 0..2
        ({"layer": -1}, "layer"),
        ({"pooling": "max"}, "pooling"),
        ({"encoding_format": "int8"}, "encoding_format"),
        ({"dimensions": 16}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input[0]"),
        ({"input": [1, 2, 10**6]}, "input"),
        ({"input": [[1], [2, 10**6]]}, "input[1]"),
        ({"input": [1] * 129}, "input"),  # rope's max_context is 128
        ({"input": ["a"] * 257}, "input"),
        ({"input": [[1] * 120] * 70}, "input"),  # 8,400 tokens in all
        ({"input": "x" * 100_000}, "input"),
        ({"input": 5}, "input"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    client: httpx.Client, change: dict[str, Any], field: str
) -> None:
    answer = client.post("/v1/embeddings", json={**GOOD, **change})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field.split("[")[0] and error["message"].startswith(field), error


def test_the_sdk_raises_for_an_unknown_model(server: Running) -> None:
    with pytest.raises(openai.NotFoundError, match="sundial"):
        client_of(server).embeddings.create(model="sundial", input="a")
