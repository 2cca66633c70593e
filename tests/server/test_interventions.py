"""The interventions of ``POST /v1/trace`` on the tiny checkpoints of all ten schemes, each
checked against what the scheme's design claims or against a reference forward of the same
weights run here: a position offset leaves the relative schemes' logits as they are and moves
the absolute schemes'; an ablated head is a zeroed slice of the output projection; dropping the
positional signal everywhere is the ``none`` scheme; the logit lens's last layer is the served
distribution.

The trace exposes the logits through the next token's full distribution (``top`` = the
vocabulary) and each prompt token's surprisal; both are exact float32."""

from __future__ import annotations

import copy
import math
from typing import Any

import httpx
import pytest
import torch

from model.config import ModelConfig
from model.positional import SCHEMES
from model.transformer import Transformer
from tests.server.conftest import Running
from tests.server.test_trace import PROMPT, model_of, stage

# fox, cope and path see positions only through the content (gates, transitions), so they are
# relative too.
RELATIVE = (
    "rope", "alibi", "t5", "none", "fox", "cope", "stickbreaking", "pope", "path", "pathfox",
)  # fmt: skip
ABSOLUTE = ("integer", "binary", "sinusoidal", "learned", "mds", "lowrank")
# FIRE's distance is normalised by max(L, i): relative while every query stays below L, not
# past it, so an offset claims neither (its bias is tested against T5's and ALiBi's instead).
# irope's NoPE layers scale their queries by Llama 4's temperature, a function of the absolute
# position (the test's tiny irope has it from position 15): an offset moves it there.
NEITHER = ("fire", "irope")
OFFSETS = (1, 7, 100)
assert set(RELATIVE + ABSOLUTE + NEITHER) == set(SCHEMES)


def trace(client: httpx.Client, model: str, **body: Any) -> dict[str, Any]:
    request = {"model": model, "prompt": PROMPT, "top": 2**16, "attention": False, **body}
    response = client.post("/v1/trace", json=request)
    assert response.status_code == 200, response.text
    return response.json()


def scores(result: dict[str, Any]) -> torch.Tensor:
    """Log-probabilities [V] of the next token (ids in order), then of each prompt token [T-1]:
    what the trace tells of its logits, up to the softmax's constant."""
    logits = stage(result, "logits")
    probs = sorted((entry["id"], entry["prob"]) for entry in logits["top"])
    next_token = torch.tensor([math.log(prob) for _, prob in probs], dtype=torch.float64)
    surprisal = torch.tensor(result["surprisal"][1:], dtype=torch.float64) * -math.log(2)
    return torch.cat([next_token, surprisal])


def reference_scores(model: Transformer, result: dict[str, Any]) -> torch.Tensor:
    """The same as ``scores`` from a plain forward of ``model`` over the traced tokens."""
    ids = torch.tensor([token["id"] for token in result["tokens"]])
    vocab = len(stage(result, "logits")["top"])  # the tokenizer's; the model may pad past it
    with torch.inference_mode():
        logits = model(ids.unsqueeze(0))[0, :, :vocab].double()  # [T, V]
    logprobs = logits.log_softmax(-1)
    surprisal = logprobs[:-1].gather(-1, ids[1:, None])[:, 0]
    return torch.cat([logprobs[-1], surprisal])


def fits(server: Running, scheme: str, offset: int, length: int) -> bool:
    cap = model_of(server, scheme).positional.max_positions
    return cap is None or offset + length <= cap


@pytest.mark.parametrize("scheme", RELATIVE)
def test_an_offset_leaves_relative_schemes_unchanged(
    server: Running, client: httpx.Client, scheme: str
) -> None:
    start = trace(client, scheme)
    for offset in OFFSETS:
        shifted = trace(client, scheme, position_offset=offset)
        assert shifted["positions"] == [offset + p for p in start["positions"]]
        torch.testing.assert_close(scores(shifted), scores(start), atol=1e-4, rtol=0)


@pytest.mark.parametrize("scheme", ABSOLUTE)
def test_an_offset_changes_absolute_schemes(
    server: Running, client: httpx.Client, scheme: str
) -> None:
    start = trace(client, scheme)
    length = len(start["tokens"])
    changes = []
    for offset in OFFSETS:
        if not fits(server, scheme, offset, length):
            found = client.post(
                "/v1/trace", json={"model": scheme, "prompt": PROMPT, "position_offset": offset}
            )
            assert found.status_code == 400, found.text
            assert found.json()["error"]["param"] == "position_offset"
            continue
        shifted = trace(client, scheme, position_offset=offset)
        changes.append(float((scores(shifted) - scores(start)).abs().max()))
    assert changes and max(changes) > 1e-2, changes


@pytest.mark.parametrize("scheme", SCHEMES)
def test_an_ablated_head_is_its_output_zeroed(
    server: Running, client: httpx.Client, scheme: str
) -> None:
    model = model_of(server, scheme)
    layer, head = model.config.n_layers - 1, 1
    ablated = trace(client, scheme, ablate=[{"layer": layer, "head": head}])
    reference = copy.deepcopy(model)
    width = model.config.head_dim
    with torch.no_grad():  # proj reads head h from columns h·hd..(h+1)·hd of its input
        reference.blocks[layer].attention.proj.weight[:, head * width : (head + 1) * width] = 0
    torch.testing.assert_close(
        scores(ablated), reference_scores(reference, ablated), atol=1e-4, rtol=0
    )
    plain = scores(trace(client, scheme))
    assert float((scores(ablated) - plain).abs().max()) > 1e-3  # the head mattered


@pytest.mark.parametrize("scheme", SCHEMES)
def test_dropping_every_layers_positions_is_the_none_scheme(
    server: Running, client: httpx.Client, scheme: str
) -> None:
    model = model_of(server, scheme)
    dropped = trace(client, scheme, drop_positional="all")
    config = ModelConfig.from_dict({**model.config.to_dict(), "positional": {"scheme": "none"}})
    as_none = Transformer(config).eval()
    weights = {k: v for k, v in model.state_dict().items() if not k.startswith("positional.")}
    as_none.load_state_dict(weights)
    torch.testing.assert_close(
        scores(dropped), reference_scores(as_none, dropped), atol=1e-4, rtol=0
    )
    listed = trace(client, scheme, drop_positional=list(range(model.config.n_layers)))
    torch.testing.assert_close(scores(listed), scores(dropped), atol=0, rtol=0)
    if scheme != "none":  # every other scheme's positions matter to its logits
        assert float((scores(dropped) - scores(trace(client, scheme))).abs().max()) > 1e-3
    # The trace shows the pass it ran: no positional vector, rotation or bias is left in it.
    pieces = ("rotation", "position_bias", "layer_bias")
    assert [dropped[name] for name in pieces] == [None] * 3
    assert dropped["embedding"]["position_vectors"] is None


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_logit_lens_last_layer_is_the_served_distribution(
    server: Running, client: httpx.Client, scheme: str
) -> None:
    result = trace(client, scheme, logit_lens=True, top=3)
    lens = result["logit_lens"]
    model = model_of(server, scheme)
    length = len(result["tokens"])
    assert len(lens["ids"]) == model.config.n_layers
    assert all(len(layer) == length and len(layer[0]) == 3 for layer in lens["ids"])
    served = stage(result, "logits")["top"]
    assert lens["ids"][-1][-1] == [entry["id"] for entry in served]
    assert lens["probs"][-1][-1] == pytest.approx([entry["prob"] for entry in served], abs=1e-6)
    ids = torch.tensor([token["id"] for token in result["tokens"]])
    vocab = len(trace(client, scheme)["next_token"]["stages"][0]["top"])
    with torch.inference_mode():
        top = model(ids.unsqueeze(0))[0, :, :vocab].float().softmax(-1).topk(3, dim=-1)
    assert lens["ids"][-1] == top.indices.tolist()  # at every position, not only the last
    torch.testing.assert_close(torch.tensor(lens["probs"][-1]), top.values, atol=1e-5, rtol=0)
    for layer in lens["probs"]:
        for row in layer:
            assert row == sorted(row, reverse=True) and 0 < sum(row) <= 1 + 1e-5


def test_interventions_change_the_traced_attention(client: httpx.Client) -> None:
    plain = trace(client, "alibi", attention=True)
    dropped = trace(client, "alibi", attention=True, drop_positional=[0])
    assert dropped["attention"][0] != plain["attention"][0]  # layer 0 lost its bias


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"ablate": [{"layer": 2, "head": 0}]}, "ablate", "ablate[0].layer is 2"),
        ({"ablate": [{"layer": 0, "head": 0}, {"layer": 0, "head": 4}]}, "ablate", "4 heads"),
        ({"ablate": [{"layer": 0}]}, "ablate", "required"),
        ({"ablate": [{"layer": -1, "head": 0}]}, "ablate", "greater than or equal to 0"),
        ({"drop_positional": [0, 5]}, "drop_positional", "drop_positional[1] is 5"),
        ({"drop_positional": "some"}, "drop_positional", "all"),
        ({"position_offset": -1}, "position_offset", "0"),
        ({"position_offset": 1.5}, "position_offset", "integer"),
        ({"logit_lens": "yes"}, "logit_lens", "bool"),
    ],
)
def test_bad_interventions_are_400s_naming_the_field(
    client: httpx.Client, fields: dict[str, Any], param: str, says: str
) -> None:
    response = client.post("/v1/trace", json={"model": "rope", "prompt": PROMPT, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_an_offset_past_the_table_is_a_400(client: httpx.Client) -> None:
    length = len(trace(client, "learned")["tokens"])
    cap = client.get("/v1/models").json()["data"]
    learned = next(entry for entry in cap if entry["id"] == "learned")["max_positions"]
    assert trace(client, "learned", position_offset=learned - length)["positions"][-1] == (
        learned - 1
    )
    response = client.post(
        "/v1/trace",
        json={"model": "learned", "prompt": PROMPT, "position_offset": learned - length + 1},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "position_offset" and str(learned) in error["message"]
