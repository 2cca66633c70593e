"""The configuration dataclasses and the named presets: config.json → ModelConfig → Transformer.

Every architectural difference between checkpoints is data in ``ModelConfig`` (as in litgpt's
Config); the positional scheme and its parameters live in the ``positional`` dict, whose keys are
checked by the scheme's own parameter dataclass (see ``model.positional``). ``TrainConfig`` is the
training recipe (optimiser, schedule, data order). ``PRESETS`` names whole recipes, litgpt's
``name_to_config``: ``shipped`` is what built the shipped checkpoints and what ``ordinal train``
uses unless told otherwise; ``v2`` built the previous checkpoints (the reference of the recipe
ablations) and ``v1`` is the first recipe (their baseline); ``tiny`` runs in seconds (CI).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.device import DTYPES
from model.errors import ConfigError
from model.files import write_json_atomic

NORMS = ("layernorm", "rmsnorm")
# gelu_tanh is GPT-2's tanh approximation of GELU (also several times faster on CPU); relu2 is
# ReLU squared (Primer; modded-nanogpt).
MLPS = ("gelu", "gelu_tanh", "swiglu", "relu2")
# adamw: AdamW for every parameter. muon: Muon (torch.optim.Muon) for the blocks' matrices,
# AdamW for the embeddings, gains, biases and positional parameters.
OPTIMIZERS = ("adamw", "muon")
# Where a training sequence may start: at a speech (document) boundary only, or also at any
# line of a speech (see lab.data.TrainingSequences).
SEQUENCE_STARTS = ("speech", "line")
# The learning-rate shape after warmup: cosine decay to min_lr over the remaining steps, or
# warmup-stable-decay (Hägele et al. 2024): flat at the peak, then a linear cooldown to min_lr
# over the last ``cooldown_fraction`` of the steps (TrainConfig.lr_at).
SCHEDULES = ("cosine", "wsd")
TRAIN_PRECISIONS = ("float32", "bfloat16")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {list(choices)}, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer.

    ``context_length`` is the length the model was trained on; ``max_positions`` is the hard cap
    for schemes that keep a table of positions (``PositionalScheme.is_table``). ``dtype`` is the
    dtype the weights are stored in on disk (the run dtype is chosen at load time). ``qk_norm``
    RMS-normalises each head's queries and keys (with a learned gain per dimension) before the
    positional rotation and the dot product. ``n_kv_heads`` below ``n_heads`` is grouped-query
    attention (Llama-family models): each key/value head serves ``n_heads / n_kv_heads`` query
    heads, and the cache stores only the key/value heads; None means one per query head.
    ``norm_eps`` is the norms' epsilon; None keeps torch's default (LayerNorm 1e-5, RMSNorm the
    run dtype's machine epsilon), which every checkpoint trained here uses.
    """

    vocab_size: int = 2048
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    d_ff: int = 512
    context_length: int = 128
    max_positions: int = 512
    dropout: float = 0.0
    norm: str = "layernorm"
    norm_eps: float | None = None
    mlp: str = "gelu"
    bias: bool = False
    tie_embeddings: bool = True
    qk_norm: bool = False
    positional: dict[str, Any] = field(default_factory=lambda: {"scheme": "rope"})
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "context_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        kv_heads = self.n_kv_heads
        if kv_heads is not None and (
            not isinstance(kv_heads, int)
            or isinstance(kv_heads, bool)
            or kv_heads < 1
            or self.n_heads % kv_heads
        ):
            raise ConfigError(
                f"n_kv_heads must be a positive integer dividing n_heads ({self.n_heads}), "
                f"got {kv_heads!r}"
            )
        if self.norm_eps is not None and not (
            isinstance(self.norm_eps, int | float) and 0 < self.norm_eps < 1
        ):
            raise ConfigError(f"norm_eps must be a number in (0, 1), got {self.norm_eps!r}")
        if self.max_positions < self.context_length:
            raise ConfigError(
                f"max_positions ({self.max_positions}) must be ≥ context_length "
                f"({self.context_length})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout!r}")
        _check_choice("norm", self.norm, NORMS)
        _check_choice("mlp", self.mlp, MLPS)
        _check_choice("dtype", self.dtype, DTYPES)
        for name in ("bias", "tie_embeddings", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.positional, dict) or "scheme" not in self.positional:
            raise ConfigError('positional must be a dict with a "scheme" key')
        _ = self.scheme_params  # validates the scheme name and its parameters (resolved once)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def key_dim(self) -> int:
        """The width of a key as attention reads it and the cache stores it: a head's, times
        the scheme's ``key_width_factor`` (PoPE's (cos, sin) parts: 2)."""
        from model.positional import SCHEMES  # the scheme's class: torch, asked by the cache only

        return self.head_dim * SCHEMES[self.scheme].key_width_factor

    @property
    def key_value_heads(self) -> int:
        """How many key/value heads attention has (and the cache stores)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def scheme(self) -> str:
        return self.positional["scheme"]

    @functools.cached_property
    def scheme_params(self) -> Any:
        """The scheme's parameter dataclass, checked once per config. The schemes (and torch)
        are imported here, not with this module: reading a config, a preset or a default needs
        no torch (litgpt's config resolves its classes lazily too)."""
        from model.positional import scheme_params

        return scheme_params(self)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a dict, rejecting unknown keys with the list of valid ones."""
        _reject_unknown(cls, data, "config key(s)", "valid keys")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        """Write config.json atomically."""
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path} is not valid JSON: {error}") from None
        return cls.from_dict(data)


# Smallest valid value of the TrainConfig counts that must be positive (all others: 0).
_TRAIN_MINIMUM = {
    "steps": 1,
    "batch_size": 1,
    "grad_accum": 1,
    "eval_every": 1,
    "eval_windows": 1,
    "save_every": 1,
}
_TRAIN_CHOICES = {
    "optimizer": OPTIMIZERS,
    "sequence_starts": SEQUENCE_STARTS,
    "schedule": SCHEDULES,
    "precision": TRAIN_PRECISIONS,
}


@dataclass(frozen=True)
class TrainConfig:
    """The training recipe. Its defaults are the ``shipped`` preset's (``ordinal train --help``
    shows them, read from here).

    ``lr`` is AdamW's peak learning rate; under ``optimizer="muon"`` the blocks' matrices take
    ``muon_lr`` instead (Muon's updates are orthogonalised, so its scale is its own), on the
    same warmup-and-cosine shape. ``weight_decay`` applies to matrices (and the embedding),
    under either optimiser. ``compile`` runs the forward pass and loss through
    ``torch.compile``: faster steps after a one-time compilation, but not bit for bit the eager
    run's (fused kernels round differently), so no preset uses it (docs/performance.md).

    ``schedule`` is the shape after warmup (``SCHEDULES``; ``lr_at``). ``ema_decay`` above 0
    keeps an exponential moving average of the weights over the steps after the first
    ``ema_start`` share of them, and the checkpoint written at the last step holds that average
    instead of the last weights (``lab.train.WeightAverage``). ``precision="bfloat16"`` runs
    the forward and backward under autocast; the weights, optimiser state and loss stay float32
    (``lab.train.summed_loss``). The ``next`` preset uses the average and bfloat16, measured
    in checkpoints/README.md's ablations; wsd did not pay there.
    """

    steps: int = 2000
    batch_size: int = 32
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    optimizer: str = "muon"
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    sequence_starts: str = "line"
    eval_every: int = 500
    eval_windows: int = 64
    save_every: int = 500
    seed: int = 1337
    threads: int = 0  # 0 = torch's default
    compile: bool = False
    schedule: str = "cosine"
    cooldown_fraction: float = 0.2  # wsd: the share of the steps spent decaying to min_lr
    ema_decay: float = 0.0  # 0: no average (the checkpoint holds the last weights)
    ema_start: float = 0.8  # the share of the steps after which the average starts
    precision: str = "float32"

    def __post_init__(self) -> None:
        # A wrong type or range would otherwise surface as a TypeError or ZeroDivisionError
        # only after the corpus has been encoded.
        for name, kind in _train_field_types().items():
            value = getattr(self, name)
            if kind is str:
                _check_choice(f"train.{name}", value, _TRAIN_CHOICES[name])
                continue
            if kind is bool:
                if not isinstance(value, bool):
                    raise ConfigError(f"train.{name} must be true or false, got {value!r}")
                continue
            allowed = int if kind is int else (int, float)
            if isinstance(value, bool) or not isinstance(value, allowed):
                expected = "an integer" if kind is int else "a number"
                raise ConfigError(f"train.{name} must be {expected}, got {value!r}")
            smallest = _TRAIN_MINIMUM.get(name, 0)
            if name != "seed" and value < smallest:
                raise ConfigError(f"train.{name} must be ≥ {smallest}, got {value!r}")
        for name in ("lr", "muon_lr"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name} must be positive, got {getattr(self, name)!r}")
        for name in ("muon_momentum", "ema_decay", "ema_start"):
            if getattr(self, name) >= 1:
                raise ConfigError(f"train.{name} must be < 1, got {getattr(self, name)!r}")
        if not 0 < self.cooldown_fraction <= 1:
            raise ConfigError(
                f"train.cooldown_fraction must be in (0, 1], got {self.cooldown_fraction!r}"
            )
        if self.schedule == "wsd" and self.warmup_steps + self.cooldown_steps > self.steps:
            raise ConfigError(
                f"train.warmup_steps ({self.warmup_steps}) and the wsd cooldown "
                f"({self.cooldown_steps} steps) must fit in train.steps ({self.steps})"
            )

    @property
    def cooldown_steps(self) -> int:
        """wsd: how many of the last steps decay to min_lr (at least one)."""
        return max(1, round(self.cooldown_fraction * self.steps))

    @property
    def ema_start_step(self) -> int:
        """The number of steps done before the weight average starts."""
        return round(self.ema_start * self.steps)

    def lr_at(self, step: int) -> float:
        """Linear warmup to ``lr``, then (``schedule``) cosine decay to ``min_lr`` at the last
        step, or wsd: ``lr`` until the cooldown, then linear steps down to ``min_lr`` exactly at
        the last step (step ``steps`` − 1)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "wsd":
            cooling = step - (self.steps - self.cooldown_steps) + 1  # 1..cooldown_steps
            share = min(1.0, max(0, cooling) / self.cooldown_steps)
            return self.lr - (self.lr - self.min_lr) * share
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """Build from a dict, rejecting unknown keys with the list of valid ones."""
        _reject_unknown(cls, data, "train setting(s)", "valid")
        return cls(**data)


def _reject_unknown(cls: type, data: Mapping[str, Any], what: str, valid_label: str) -> None:
    """A ConfigError naming the keys of ``data`` that are not fields of ``cls``, and the valid."""
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - valid)
    if unknown:
        raise ConfigError(f"unknown {what} {unknown}; {valid_label}: {sorted(valid)}")


@functools.cache
def _train_field_types() -> dict[str, type]:
    """TrainConfig's field types as classes (annotations are strings under postponed evaluation)."""
    return typing.get_type_hints(TrainConfig)


@dataclass(frozen=True)
class Preset:
    """A whole recipe by name: the architecture (every ``ModelConfig`` field but ``positional``
    and ``dtype``: the same for every scheme), each scheme's own parameters, and the training
    settings. Only the positional scheme differs between the checkpoints one preset builds."""

    model: Mapping[str, Any]
    train: TrainConfig
    positional: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def model_config(self, scheme: str) -> ModelConfig:
        """The preset's architecture with ``scheme`` and that scheme's parameters."""
        positional = {**self.positional.get(scheme, {}), "scheme": scheme}
        return ModelConfig.from_dict({**self.model, "positional": positional})


# What built the shipped checkpoints (checkpoints/README.md, "Recipe").
_SHIPPED_MODEL = {
    "vocab_size": 2048,
    "d_model": 128,
    "n_layers": 4,
    "n_heads": 4,
    "d_ff": 512,
    "context_length": 128,
    "max_positions": 128,
    "dropout": 0.0,
    "norm": "layernorm",
    "mlp": "relu2",
    "bias": False,
    "tie_embeddings": True,
    "qk_norm": False,
}
# Sinusoidal is scaled so its entries start with the spread of the learned table (std 0.02)
# rather than swamping token embeddings 35-fold; integer and binary stay the seeds' raw baselines.
_V2_POSITIONAL: dict[str, dict[str, Any]] = {
    "sinusoidal": {"scale": 0.028},
    "mds": {"rank": 32},
    "lowrank": {"rank": 32},
}
# A locality prior for the two bias schemes: ALiBi's slopes ×4 (1, 1/4, 1/16, 1/64 for 4 heads),
# and t5's table starting there: 2.065 and 2.063 bpc against 2.083 and 2.079 without, and better
# at every length (checkpoints/README.md, "The locality prior").
# irope: Llama 4's schedule (every fourth layer NoPE), its temperature from the trained length on.
_SHIPPED_POSITIONAL = {
    **_V2_POSITIONAL,
    "alibi": {"scale": 4.0},
    "t5": {"alibi_init": 4.0},
    "irope": {"temperature_floor": 128},
}

PRESETS: dict[str, Preset] = {
    # The recipe every shipped checkpoint was trained with (checkpoints/README.md, issue #25):
    # v2 with 2,400 steps in bfloat16 (compiled: uncompiled bfloat16 gains little) and the last
    # fifth of the steps averaged into the saved weights.
    "shipped": Preset(
        model=_SHIPPED_MODEL,
        train=TrainConfig(steps=2400, precision="bfloat16", compile=True, ema_decay=0.99),
        positional=_SHIPPED_POSITIONAL,
    ),
    # The second recipe (Muon, ReLU², no dropout, sequences from any line; 2,000 float32 steps):
    # what the previous checkpoints were trained with, and the reference of the ablations.
    "v2": Preset(model=_SHIPPED_MODEL, train=TrainConfig(), positional=_V2_POSITIONAL),
    # The first recipe (AdamW, GELU, dropout 0.1, sequences from speech starts): the baseline
    # that checkpoints/README.md's ablations start from.
    "v1": Preset(
        model={**_SHIPPED_MODEL, "mlp": "gelu", "dropout": 0.1},
        train=TrainConfig(optimizer="adamw", sequence_starts="speech"),
        positional=_V2_POSITIONAL,
    ),
    # The same code path in seconds (CI: `make checkpoints PRESET=tiny`): a one-layer model,
    # a few steps. Its own tokenizer size, so it never reuses the shipped tokenizer by accident.
    "tiny": Preset(
        model={
            **_SHIPPED_MODEL,
            "vocab_size": 300,
            "d_model": 32,
            "n_layers": 1,
            "n_heads": 2,
            "d_ff": 64,
            "context_length": 32,
            "max_positions": 32,
        },
        train=TrainConfig(
            steps=6, batch_size=4, warmup_steps=2, eval_every=6, eval_windows=4, save_every=6
        ),
        positional={"sinusoidal": {"scale": 0.028}, "mds": {"rank": 8}, "lowrank": {"rank": 8}},
    ),
}
DEFAULT_PRESET = "shipped"
# ModelConfig fields that `ordinal train` also takes as flags (--d-model 192, ...).
MODEL_SIZE_FLAGS = (
    "d_model",
    "n_layers",
    "n_heads",
    "d_ff",
    "context_length",
    "max_positions",
    "vocab_size",
)


def preset(name: str) -> Preset:
    """The preset called ``name``; an unknown name is a ConfigError listing the valid ones."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; valid: {sorted(PRESETS)}")
    return PRESETS[name]
