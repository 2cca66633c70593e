"""Positional schemes: one small module each, one interface (``PositionalScheme``), one registry.

``SCHEMES`` maps a config's ``positional.scheme`` to its class; ``build_scheme(config)`` builds the
module the transformer uses. Each scheme's parameters are a frozen dataclass (``Params``), so an
unknown key or a bad value is an error that names it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from model.errors import ConfigError

if TYPE_CHECKING:
    from model.config import ModelConfig
    from model.positional.base import (
        LayerBias,
        PositionalScheme,
        PositionOutOfRange,
        positions_table,
    )
    from model.positional.mds import MdsPositions

    TABLE_SCHEMES: tuple[str, ...]

# Each scheme's name → "module:class" in this package, in the order tables list them. The class
# is imported on first use (as litgpt's config resolves its classes), so the names are known
# without torch: ``ordinal --help`` lists them from here. A new scheme is its module and a line.
_CLASSES = {
    "none": "none:NoPositions",
    "integer": "integer:IntegerPositions",
    "binary": "binary:BinaryPositions",
    "sinusoidal": "sinusoidal:SinusoidalPositions",
    "learned": "learned:LearnedPositions",
    "rope": "rope:RotaryPositions",
    "alibi": "alibi:AlibiPositions",
    "t5": "t5:T5Positions",
    "mds": "mds:MdsPositions",
    "lowrank": "lowrank:LowRankPositions",
    "fox": "fox:ForgettingPositions",
    "cope": "cope:ContextualPositions",
    "fire": "fire:FirePositions",
    "irope": "irope:InterleavedPositions",
    "stickbreaking": "stickbreaking:StickBreakingPositions",
    "pope": "pope:PolarPositions",
    "path": "path:PathPositions",
    "pathfox": "path:PathForgettingPositions",
}


class SchemeRegistry(Mapping[str, "type[PositionalScheme]"]):
    """``SCHEMES[name]`` is the scheme's class, imported when first asked for; iterating gives
    the names alone (no import)."""

    def __getitem__(self, name: str) -> type[PositionalScheme]:
        module, cls = _CLASSES[name].split(":")
        scheme: type[PositionalScheme] = getattr(
            importlib.import_module(f"{__name__}.{module}"), cls
        )
        assert scheme.name == name, f"{cls} is registered as {name!r}, names itself {scheme.name}"
        return scheme

    def __contains__(self, name: object) -> bool:  # without importing the class
        return name in _CLASSES

    def __iter__(self) -> Iterator[str]:
        return iter(_CLASSES)

    def __len__(self) -> int:
        return len(_CLASSES)


SCHEMES = SchemeRegistry()


def __getattr__(name: str) -> Any:
    """The torch-side names this package re-exports, imported on first use."""
    if name == "TABLE_SCHEMES":  # positions are a table capped at max_positions (each says so)
        return tuple(scheme for scheme in SCHEMES if SCHEMES[scheme].is_table)
    if name in ("LayerBias", "PositionalScheme", "PositionOutOfRange", "positions_table"):
        return getattr(importlib.import_module(f"{__name__}.base"), name)
    if name == "MdsPositions":
        return SCHEMES["mds"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    "MdsPositions",
    "PositionOutOfRange",
    "PositionalScheme",
    "build_scheme",
    "positions_table",
    "scheme_params",
]
