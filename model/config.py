"""The one configuration dataclass: config.json → ModelConfig → Transformer.

Every architectural difference between checkpoints is data in this dataclass (as in litgpt's
Config); the positional scheme and its parameters live in the ``positional`` dict, whose keys are
checked by the scheme's own parameter dataclass (see ``model.positional``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NORMS = ("layernorm", "rmsnorm")
# gelu_tanh is GPT-2's tanh approximation of GELU (also several times faster on CPU).
MLPS = ("gelu", "gelu_tanh", "swiglu")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A config value is unknown, missing or inconsistent; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer.

    ``context_length`` is the length the model was trained on; ``max_positions`` is the hard cap
    for schemes that keep a table of positions (learned, mds, lowrank). ``dtype`` is the dtype the
    weights are stored in on disk (the run dtype is chosen at load time).
    """

    vocab_size: int = 2048
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 512
    context_length: int = 128
    max_positions: int = 512
    dropout: float = 0.0
    norm: str = "layernorm"
    mlp: str = "gelu"
    bias: bool = False
    tie_embeddings: bool = True
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
        if not isinstance(self.positional, dict) or "scheme" not in self.positional:
            raise ConfigError('positional must be a dict with a "scheme" key')
        # Imported here because the schemes import this module for the type.
        from model.positional import scheme_params

        scheme_params(self)  # validates the scheme name and its parameters

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def scheme(self) -> str:
        return self.positional["scheme"]

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a dict, rejecting unknown keys with the list of valid ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config key(s) {unknown}; valid keys: {sorted(known)}")
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


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {list(choices)}, got {value!r}")


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON to ``path`` via a temp file in the same folder and os.replace."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder and os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; checkpoints are shared read-only
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
