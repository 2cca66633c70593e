"""ModelConfig and TrainConfig reject bad input with a message that names the field and the valid
choices, every architectural combination ModelConfig accepts builds a model that runs, every
preset fits every scheme, and the atomic writers never leave a partial file."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import torch

from model.config import (
    MLPS,
    NORMS,
    PRESETS,
    ConfigError,
    ModelConfig,
    TrainConfig,
    preset,
)
from model.files import write_atomic, write_text_atomic
from model.positional import SCHEMES
from model.transformer import Transformer
from tests.model.conftest import ALL_SCHEMES, random_model, random_tokens, tiny_config


def test_unknown_key_lists_the_valid_keys() -> None:
    data = {**tiny_config().to_dict(), "n_layer": 3}
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['n_layer'\]") as error:
        ModelConfig.from_dict(data)
    for key in ("n_layers", "d_model", "positional", "tie_embeddings"):
        assert repr(key) in str(error.value)


def test_unknown_scheme_lists_the_valid_schemes() -> None:
    with pytest.raises(ConfigError, match="'xpos'") as error:
        tiny_config(positional={"scheme": "xpos"})
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
        ({"scheme": "rope", "scaling": "longrope"}, "scaling"),
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


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_every_scheme(name: str) -> None:
    recipe = preset(name)
    for scheme in ALL_SCHEMES:
        config = recipe.model_config(scheme)
        assert config.scheme == scheme
        assert {k: v for k, v in config.to_dict().items() if k in recipe.model} == dict(
            recipe.model
        )
        Transformer(config)  # the scheme's parameters fit the preset's architecture
    assert isinstance(recipe.train, TrainConfig)


def test_unknown_preset_lists_the_valid_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown preset 'huge'; valid: \['shipped', 'tiny', 'v1', 'v2'\]"
    ):
        preset("huge")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"steps": 2.0}, "train.steps must be an integer"),
        ({"steps": True}, "train.steps must be an integer"),
        ({"lr": "fast"}, "train.lr must be a number"),
        ({"batch_size": 0}, r"train.batch_size must be ≥ 1"),
        ({"lr": 0.0}, "train.lr must be positive"),
        ({"muon_lr": 0.0}, "train.muon_lr must be positive"),
        ({"muon_momentum": 1.0}, "train.muon_momentum must be < 1"),
        ({"optimizer": "sgd"}, r"train.optimizer must be one of \['adamw', 'muon'\]"),
        ({"sequence_starts": "word"}, r"train.sequence_starts must be one of"),
        ({"compile": 1}, "train.compile must be true or false"),
    ],
)
def test_bad_train_setting_is_named(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**changes)
    assert TrainConfig(lr=1, min_lr=0).lr == 1  # an integer is a number
    with pytest.raises(ConfigError, match=r"unknown train setting\(s\) \['stepz'\]"):
        TrainConfig.from_dict({"stepz": 3})


def test_relu2_is_relu_squared() -> None:
    model = Transformer(tiny_config("rope", mlp="relu2")).eval()
    mlp = model.blocks[0].mlp
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(mlp(x), mlp.down(torch.relu(mlp.up(x)) ** 2))


def test_qk_norm_normalises_each_heads_queries_and_keys() -> None:
    """With unit gains every query and key has RMS 1 per head, so scaling the QKV projection's
    query and key rows changes nothing; without QK-norm it changes the logits."""
    tokens = random_tokens(2, 9, seed=1)
    for qk_norm in (True, False):
        torch.manual_seed(0)
        model = Transformer(tiny_config("rope", qk_norm=qk_norm)).eval()
        assert (model.blocks[0].attention.qk_norm is not None) == qk_norm
        with torch.no_grad():
            before = model(tokens)
            for block in model.blocks:
                block.attention.qkv.weight[: 2 * 32] *= 7.0
            after = model(tokens)
        assert torch.allclose(before, after, atol=1e-5) == qk_norm
    names = [name for name, _ in Transformer(tiny_config(qk_norm=True)).named_parameters()]
    assert "blocks.0.attention.qk_norm" in names
    assert not any("qk_norm" in name for name, _ in Transformer(tiny_config()).named_parameters())


def test_atomic_writers_leave_the_old_file_on_error(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "state.bin"
    write_atomic(path, lambda staging: staging.write_bytes(b"old"))
    assert path.read_bytes() == b"old" and oct(path.stat().st_mode & 0o777) == "0o644"

    def fail(staging: Path) -> None:
        staging.write_bytes(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomic(path, fail)
    assert path.read_bytes() == b"old"
    write_text_atomic(path, "new")
    assert path.read_text() == "new"
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.bin"]  # no temp file left


@pytest.mark.parametrize("scheme", ["rope", "alibi", "learned"])
def test_qk_norm_and_relu2_decode_incrementally_as_a_full_forward(scheme: str) -> None:
    """The cached decode path with the new options (keys are cached normalised): a rotation,
    a score bias and an additive scheme."""
    from tests.model.test_transformer import SEQUENCE_LENGTH, decode_and_compare

    model = random_model(scheme, seed=1, qk_norm=True, mlp="relu2")
    tokens = random_tokens(4, SEQUENCE_LENGTH, seed=2)
    with torch.no_grad():
        decode_and_compare(model, tokens, model(tokens), seed=3)


def test_key_value_heads_and_norm_eps_are_checked() -> None:
    assert tiny_config().key_value_heads == 4  # None: one key/value head per query head
    assert tiny_config(n_kv_heads=2).key_value_heads == 2
    for bad in (3, 0, True, 2.0):
        with pytest.raises(ConfigError, match="n_kv_heads must be a positive integer dividing"):
            tiny_config(n_kv_heads=bad)
    with pytest.raises(ConfigError, match="norm_eps"):
        tiny_config(norm_eps=0)
    layer_norm = Transformer(tiny_config(norm_eps=1e-3)).final_norm
    rms_norm = Transformer(tiny_config(norm="rmsnorm", norm_eps=1e-6)).final_norm
    assert isinstance(layer_norm, torch.nn.LayerNorm) and layer_norm.eps == 1e-3
    assert isinstance(rms_norm, torch.nn.RMSNorm) and rms_norm.eps == 1e-6
    assert Transformer(tiny_config()).final_norm.eps == 1e-5  # torch's default, as before


def test_wsd_is_flat_at_the_peak_then_linear_down_to_min_lr_over_the_cooldown() -> None:
    recipe = TrainConfig(
        steps=100, warmup_steps=10, lr=1e-2, min_lr=1e-3, schedule="wsd", cooldown_fraction=0.2
    )
    assert recipe.cooldown_steps == 20
    curve = [recipe.lr_at(step) for step in range(recipe.steps)]
    assert curve[:10] == [recipe.lr * (step + 1) / 10 for step in range(10)]  # the same warmup
    assert curve[10:80] == [recipe.lr] * 70  # stable
    drops = [before - after for before, after in itertools.pairwise(curve[79:])]
    assert drops == pytest.approx([(recipe.lr - recipe.min_lr) / 20] * 20)  # linear
    assert curve[-1] == pytest.approx(recipe.min_lr)  # reached exactly at the last step
    cosine = TrainConfig(steps=100, warmup_steps=10, lr=1e-2, min_lr=1e-3)
    assert cosine.schedule == "cosine" and cosine.lr_at(50) < recipe.lr_at(50)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"schedule": "linear"}, "train.schedule"),
        ({"cooldown_fraction": 0.0}, "train.cooldown_fraction"),
        ({"cooldown_fraction": 1.5}, "train.cooldown_fraction"),
        ({"schedule": "wsd", "steps": 10, "warmup_steps": 9, "cooldown_fraction": 0.5}, "fit"),
        ({"ema_decay": 1.0}, "train.ema_decay"),
        ({"ema_decay": -0.1}, "train.ema_decay"),
        ({"ema_start": 1.0}, "train.ema_start"),
    ],
)
def test_bad_schedule_and_average_settings_name_the_field(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict(changes)


def test_the_shipped_recipe_is_v2_with_only_the_measured_changes() -> None:
    """The retraining changed the budget, precision, compilation and weight average, and the
    locality prior of alibi and t5 (their own parameters), and nothing else: same architecture,
    data order, optimiser and schedule."""
    shipped, previous = preset("shipped"), preset("v2")
    assert shipped.model == previous.model
    changed_schemes = {
        scheme
        for scheme in {*shipped.positional, *previous.positional}
        if shipped.positional.get(scheme) != previous.positional.get(scheme)
    }
    assert changed_schemes == {"alibi", "t5", "irope"}  # irope: a scheme v2 did not have
    assert shipped.positional["irope"] == {"temperature_floor": 128}
    assert shipped.positional["alibi"] == {"scale": 4.0}
    assert shipped.positional["t5"] == {"alibi_init": 4.0}
    changed = {
        name
        for name in TrainConfig.__dataclass_fields__
        if getattr(shipped.train, name) != getattr(previous.train, name)
    }
    assert changed == {"steps", "precision", "compile", "ema_decay"}
    assert shipped.train.schedule == "cosine" and shipped.train.steps > previous.train.steps
    for name, recipe in PRESETS.items():
        if name != "shipped":
            assert recipe.train.schedule == "cosine" and recipe.train.ema_decay == 0.0
