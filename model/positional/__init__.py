"""Positional schemes: one small module each, one interface (``PositionalScheme``), one registry.

``SCHEMES`` maps a config's ``positional.scheme`` to its class; ``build_scheme(config)`` builds the
module the transformer uses. Each scheme's parameters are a frozen dataclass (``Params``), so an
unknown key or a bad value is an error that names it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from model.errors import ConfigError
from model.positional.alibi import AlibiPositions
from model.positional.base import LayerBias, PositionalScheme, PositionOutOfRange, positions_table
from model.positional.binary import BinaryPositions
from model.positional.cope import ContextualPositions
from model.positional.fire import FirePositions
from model.positional.fox import ForgettingPositions
from model.positional.integer import IntegerPositions
from model.positional.learned import LearnedPositions
from model.positional.lowrank import LowRankPositions
from model.positional.mds import MdsPositions
from model.positional.none import NoPositions
from model.positional.rope import RotaryPositions
from model.positional.sinusoidal import SinusoidalPositions
from model.positional.t5 import T5Positions

if TYPE_CHECKING:
    from model.config import ModelConfig

SCHEMES: dict[str, type[PositionalScheme]] = {
    scheme.name: scheme
    for scheme in (
        NoPositions,
        IntegerPositions,
        BinaryPositions,
        SinusoidalPositions,
        LearnedPositions,
        RotaryPositions,
        AlibiPositions,
        T5Positions,
        MdsPositions,
        LowRankPositions,
        ForgettingPositions,
        ContextualPositions,
        FirePositions,
    )
}

# Schemes whose positions are a table with a hard cap at max_positions (each says so itself).
TABLE_SCHEMES = tuple(name for name, scheme in SCHEMES.items() if scheme.is_table)


def scheme_params(config: ModelConfig) -> Any:
    """Validate ``config.positional`` and return the scheme's parameter dataclass."""
    settings = dict(config.positional)
    name = settings.pop("scheme")
    if name not in SCHEMES:
        raise ConfigError(f"unknown positional scheme {name!r}; valid schemes: {list(SCHEMES)}")
    params_type = SCHEMES[name].Params
    valid = [field.name for field in dataclasses.fields(params_type)]
    unknown = sorted(set(settings) - set(valid))
    if unknown:
        raise ConfigError(
            f"unknown parameter(s) {unknown} for positional scheme {name!r}; valid: {valid}"
        )
    try:
        return params_type(**settings)
    except (TypeError, ValueError) as error:
        raise ConfigError(f"positional ({name}): {error}") from None


def build_scheme(config: ModelConfig) -> PositionalScheme:
    """The positional module for ``config``."""
    try:
        return SCHEMES[config.scheme](config, config.scheme_params)
    except ValueError as error:
        if isinstance(error, ConfigError):
            raise
        raise ConfigError(f"positional ({config.scheme}): {error}") from None


__all__ = [
    "SCHEMES",
    "TABLE_SCHEMES",
    "LayerBias",
    "PositionOutOfRange",
    "PositionalScheme",
    "build_scheme",
    "positions_table",
    "scheme_params",
]
