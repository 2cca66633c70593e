"""irope (model/positional/irope.py): a schedule of rope and NoPE layers is each of them where
it says so, its window hides exactly the keys past it, Llama 4's temperature scales the NoPE
layers' queries by its formula, and the cache decodes it as the full forward does, ragged and
past the trained length."""

from __future__ import annotations

import math

import pytest
import torch

from model.errors import ConfigError
from model.transformer import AttentionRecorder, Transformer
from tests.model.conftest import random_model, random_tokens, tiny_config

PLAIN = {"window": None, "temperature_floor": None}


def twin(scheme: str, source: Transformer, **positional: object) -> Transformer:
    """A model of ``scheme`` with ``source``'s weights."""
    model = Transformer(tiny_config(scheme, positional={"scheme": scheme, **positional})).eval()
    model.load_state_dict(source.state_dict())
    return model


@pytest.mark.parametrize(("layers", "equal_to"), [("rope", "rope"), ("none", "none")])
def test_a_schedule_of_one_kind_is_that_scheme_bit_for_bit(layers: str, equal_to: str) -> None:
    source = random_model("irope", seed=1)
    irope = twin("irope", source, layers=layers, **PLAIN)
    other = twin(equal_to, source)
    tokens = random_tokens(3, 40, seed=2)
    with torch.no_grad():
        assert torch.equal(irope(tokens), other(tokens))


def test_each_layer_is_rope_or_none_as_the_schedule_says() -> None:
    """rope,none: layer 0's attention is rope's, layer 1's none's (same weights)."""
    source = random_model("irope", seed=3)
    models = {
        name: twin(name, source, **extra)
        for name, extra in (("irope", {"layers": "rope,none", **PLAIN}), ("rope", {}), ("none", {}))
    }
    tokens = random_tokens(1, 30, seed=4)
    weights = {}
    with torch.no_grad():
        for name, model in models.items():
            recorder = AttentionRecorder()
            model.traced_forward(tokens, recorder)
            weights[name] = recorder.weights
    assert torch.equal(weights["irope"][0], weights["rope"][0])
    # layer 1 reads layer 0's output, which is rope's: compare against none given that input
    assert not torch.allclose(weights["irope"][1], weights["rope"][1])
    assert models["irope"].positional.rope_layers == frozenset({0})


def test_the_window_hides_exactly_the_keys_past_it() -> None:
    model = twin("irope", random_model("irope", seed=5), layers="rope,none", window=8)
    recorder = AttentionRecorder()
    with torch.no_grad():
        model.traced_forward(random_tokens(1, 30, seed=6), recorder)
    rope_layer, nope_layer = recorder.weights  # [1, H, T, T] each
    distance = torch.arange(30)[:, None] - torch.arange(30)[None, :]
    seen = (distance >= 0) & (distance < 8)
    assert not rope_layer[..., ~seen].any() and (rope_layer[..., seen] > 0).all()
    causal = distance >= 0
    assert (nope_layer[..., causal] > 0).all()  # the NoPE layer sees every earlier key


def test_the_temperature_is_llama_4s_formula() -> None:
    scheme = random_model("irope", seed=7).positional  # temperature_floor 16, scale 0.1
    positions = torch.tensor([[0, 14, 15, 16, 47, 100]])
    scale = scheme.query_scale(positions)
    expected = [math.log(math.floor((p + 1) / 16) + 1) * 0.1 + 1 for p in positions[0].tolist()]
    assert scale.shape == (1, 1, 6, 1)
    assert scale.flatten().tolist() == pytest.approx(expected)
    assert scale[0, 0, 1, 0] == 1.0 and scale[0, 0, 2, 0] > 1.0  # it starts at the floor


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"layers": "rope,nope"}, "positional.layers must list rope or none"),
        ({"layers": ""}, "positional.layers"),
        ({"window": 0}, "positional.window must be ≥ 1"),
        ({"temperature_floor": 0}, "positional.temperature_floor must be ≥ 1"),
    ],
)
def test_bad_schedules_are_refused_by_name(params: dict, says: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=says):
        Transformer(tiny_config("irope", positional={"scheme": "irope", **params}))
