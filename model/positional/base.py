"""The interface every positional scheme implements, and the error for positions past a table.

A scheme may contribute any of three things, each computed ONCE per forward pass from the
positions and shared by all layers:

(a) ``embedding(positions)``: a vector added to the token embeddings (absolute schemes);
(b) ``rotation(positions)``: cos/sin tables that rotate queries and keys (rope);
(c) ``attention_bias(q_positions, k_positions)``: an additive bias on attention scores (alibi, t5).

The defaults contribute nothing, so ``none`` (NoPE) is the base class itself.
Schemes are pure tensor code: they know positions, never tokens, caches or requests.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor, nn

from model.positional.rotation import Rotation, apply_rotation

if TYPE_CHECKING:
    from model.config import ModelConfig


class PositionOutOfRange(ValueError):
    """A position at or past a table-based scheme's ``max_positions`` was requested."""


@dataclasses.dataclass(frozen=True)
class NoParams:
    """Schemes without parameters accept no keys beyond "scheme"."""


class PositionalScheme(nn.Module):
    """Base class and registry interface. Subclasses set ``name`` and, if any, ``Params``, and
    ``is_table`` when their positions are the rows of a table of ``config.max_positions``."""

    name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams
    # True: one stored row per position, so positions stop at config.max_positions;
    # False: a formula, computed for any position.
    is_table: ClassVar[bool] = False

    def __init__(self, config: ModelConfig, params: Any) -> None:
        super().__init__()
        self.config = config
        self.params = params
        # None = any position is fine; an int = positions must stay below it (a table's rows,
        # or a formula's own limit, such as binary's 2**bits).
        self.max_positions: int | None = config.max_positions if self.is_table else None

    def embedding(self, positions: Tensor) -> Tensor | None:
        """Additive vectors for ``positions`` [B, T] (long) → [B, T, d_model], or None."""
        return None

    def rotation(self, positions: Tensor) -> Rotation | None:
        """(cos, sin) rotating q and k at ``positions`` [B, T] → each [B, 1, T, rot], or None."""
        return None

    def attention_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        """Additive score bias for queries [B, Tq] against keys [Tk] → [B, H, Tq, Tk], or None."""
        return None

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """Apply this scheme's rotation to ``x`` [B, H, T, head_dim] (identity if it has none)."""
        rotation = self.rotation(positions)
        if rotation is None:
            return x
        return apply_rotation(x, *rotation)

    def check_positions(self, positions: Tensor) -> None:
        """Raise PositionOutOfRange if any position is at or past ``max_positions``."""
        if self.max_positions is None or positions.numel() == 0:
            return
        largest = int(positions.max())
        if largest >= self.max_positions:
            raise PositionOutOfRange(
                f"position {largest} is out of range for the '{self.name}' scheme, which has a "
                f"table of max_positions={self.max_positions} (0..{self.max_positions - 1})"
            )

    def extra_repr(self) -> str:
        return f"scheme={self.name!r}, params={self.params}"


def positions_table(n_positions: int, device: torch.device | None = None) -> Tensor:
    """Positions 0..n-1 as a [1, n] long tensor (the batch-shared layout schemes accept)."""
    return torch.arange(n_positions, device=device).unsqueeze(0)
