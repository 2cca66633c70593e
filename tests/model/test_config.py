"""ModelConfig rejects bad input with a message that names the field and the valid choices, and
every architectural combination it accepts builds a model that runs."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import torch

from model.config import MLPS, NORMS, ConfigError, ModelConfig
from model.positional import SCHEMES
from model.transformer import Transformer
from tests.model.conftest import ALL_SCHEMES, random_tokens, tiny_config


def test_unknown_key_lists_the_valid_keys() -> None:
    data = {**tiny_config().to_dict(), "n_layer": 3}
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['n_layer'\]") as error:
        ModelConfig.from_dict(data)
    for key in ("n_layers", "d_model", "positional", "tie_embeddings"):
        assert repr(key) in str(error.value)


def test_unknown_scheme_lists_the_valid_schemes() -> None:
    with pytest.raises(ConfigError, match="'cope'") as error:
        tiny_config(positional={"scheme": "cope"})
    assert all(repr(name) in str(error.value) for name in SCHEMES)
    with pytest.raises(ConfigError, match='"scheme" key'):
        tiny_config(positional={"base": 10000.0})


def test_unknown_scheme_parameter_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"\['theta'\] for positional scheme 'rope'") as error:
        tiny_config(positional={"scheme": "rope", "theta": 500000.0})
    for valid in ("base", "rotary_fraction", "scaling", "scaling_factor"):
        assert repr(valid) in str(error.value)
    with pytest.raises(ConfigError, match=r"\['bits'\] for positional scheme 'none'; valid: \[\]"):
        tiny_config(positional={"scheme": "none", "bits": 4})


@pytest.mark.parametrize(
    ("positional", "message"),
    [
        ({"scheme": "rope", "rotary_fraction": 0.0}, "rotary_fraction"),
        ({"scheme": "rope", "scaling": "yarn"}, "scaling"),
        ({"scheme": "rope", "scaling_factor": 0.5}, "scaling_factor"),
        ({"scheme": "binary", "bits": 0}, "bits"),
        ({"scheme": "t5", "num_buckets": 32, "max_distance": 10}, "max_distance"),
        ({"scheme": "mds", "rank": 0}, "rank"),
        ({"scheme": "lowrank", "rank": -1}, "rank"),
    ],
)
def test_bad_scheme_parameter_value_is_named(positional: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"positional \({positional['scheme']}\).*{message}"):
        tiny_config(positional=positional)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"positional": {"scheme": "binary", "bits": 40}}, r"bits \(40\) must be ≤ d_model \(32\)"),
        ({"positional": {"scheme": "mds", "rank": 33}}, r"rank \(33\) must be ≤ d_model \(32\)"),
        ({"positional": {"scheme": "sinusoidal"}, "d_model": 33, "n_heads": 3}, "even d_model"),
        (
            {"positional": {"scheme": "rope", "rotary_fraction": 0.1}},
            "leaves no dimension pair",
        ),
    ],
)
def test_scheme_that_does_not_fit_the_model_is_a_config_error_at_build(
    overrides: dict, message: str
) -> None:
    config = tiny_config(**overrides)
    with pytest.raises(ConfigError, match=message):
        Transformer(config)


def test_d_model_must_divide_into_heads() -> None:
    with pytest.raises(ConfigError, match=r"d_model \(30\) must be divisible by n_heads \(4\)"):
        tiny_config(d_model=30)


@pytest.mark.parametrize(
    ("field", "value"),
    [("norm", "batchnorm"), ("mlp", "relu"), ("dtype", "float64")],
)
def test_bad_choice_names_the_field_and_the_choices(field: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"{field} must be one of \[.*\], got '{value}'"):
        tiny_config(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [("n_layers", 0), ("d_model", -8), ("vocab_size", 2.5), ("n_heads", True)],
)
def test_sizes_must_be_positive_integers(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"{field} must be a positive integer"):
        tiny_config(**{field: value})


def test_other_inconsistent_values_are_named() -> None:
    with pytest.raises(ConfigError, match=r"max_positions \(16\) must be ≥ context_length"):
        tiny_config(max_positions=16)
    with pytest.raises(ConfigError, match="dropout"):
        tiny_config(dropout=1.0)
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    ("norm", "mlp", "bias", "tie"),
    list(itertools.product(NORMS, MLPS, (False, True), (False, True))),
)
def test_every_architecture_combination_builds_and_runs(
    norm: str, mlp: str, bias: bool, tie: bool
) -> None:
    config = tiny_config("rope", norm=norm, mlp=mlp, bias=bias, tie_embeddings=tie)
    model = Transformer(config).eval()
    with torch.no_grad():
        logits = model(random_tokens(2, 9, seed=0))
    assert logits.shape == (2, 9, config.vocab_size)
    assert torch.isfinite(logits).all()
    assert (model.lm_head.weight is model.token_embedding.weight) == tie
    assert (model.blocks[0].attention.qkv.bias is not None) == bias
    assert (model.blocks[0].mlp.up.bias is not None) == bias
    norm_type = torch.nn.RMSNorm if norm == "rmsnorm" else torch.nn.LayerNorm
    assert isinstance(model.final_norm, norm_type)
    expanded = 2 * config.d_ff if mlp == "swiglu" else config.d_ff
    assert model.blocks[0].mlp.up.out_features == expanded


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_config_json_round_trip(scheme: str, tmp_path: Path) -> None:
    config = tiny_config(scheme, dropout=0.1, bias=True, dtype="bfloat16")
    path = tmp_path / "run" / "config.json"
    config.save(path)
    assert ModelConfig.load(path) == config
    assert json.loads(path.read_text())["positional"]["scheme"] == scheme
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.json"]  # no temp file left


def test_loading_broken_json_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"d_model": 32,')
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        ModelConfig.load(path)


def test_replace_validates_again() -> None:
    config = tiny_config()
    assert config.replace(n_layers=3).n_layers == 3
    with pytest.raises(ConfigError, match="n_heads"):
        config.replace(n_heads=5)
