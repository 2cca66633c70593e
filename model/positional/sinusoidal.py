"""Vaswani et al.'s sinusoidal encoding: sin on even and cos on odd dimensions.

PE(p, 2i) = sin(p · base^(-2i/d)), PE(p, 2i+1) = cos(p · base^(-2i/d)). Each (sin, cos) pair is a
clock hand, so PE(p + k) is PE(p) rotated pair by pair: one block-diagonal rotation M_k for all p.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from model.positional.base import PositionalScheme


@dataclass(frozen=True)
class SinusoidalParams:
    base: float = 10000.0
    scale: float = 1.0


def position_angles(positions: Tensor, dim: int, base: float = 10000.0) -> Tensor:
    """Angles p · base^(-2i/dim) for each pair i → [..., dim/2], float64.

    The clock hands shared by sinusoidal (added as sin/cos) and rope (applied as rotations);
    float64 keeps sin/cos exact to ~1e-12 for positions in the thousands.
    """
    if dim % 2:
        raise ValueError(f"the encoding needs an even number of dimensions, got {dim}")
    pair = torch.arange(0, dim, 2, device=positions.device, dtype=torch.float64)
    return positions.to(torch.float64).unsqueeze(-1) * base ** (-pair / dim)


def sinusoidal_encoding(positions: Tensor, d_model: int, base: float = 10000.0) -> Tensor:
    """Sinusoidal vectors for arbitrary ``positions`` [...] → [..., d_model] (float32)."""
    angles = position_angles(positions, d_model, base)  # [..., d/2]
    encoding = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)
    return encoding.to(torch.float32)


def sinusoidal_table(n_positions: int, d_model: int, base: float = 10000.0) -> Tensor:
    """The sinusoidal encoding of positions 0..n_positions-1 → [n_positions, d_model]."""
    return sinusoidal_encoding(torch.arange(n_positions), d_model, base)


class SinusoidalPositions(PositionalScheme):
    name = "sinusoidal"
    kind = "added"
    claim = (
        "sinusoidal adds sines and cosines of the position: they are different at every "
        "position, so the prediction moves."
    )
    Params = SinusoidalParams

    def __init__(self, config, params: SinusoidalParams) -> None:
        super().__init__(config, params)
        if config.d_model % 2:  # refuse at build time, not at the first forward pass
            raise ValueError(f"the sinusoidal scheme needs an even d_model, got {config.d_model}")

    def embedding(self, positions: Tensor) -> Tensor:
        encoding = sinusoidal_encoding(positions, self.config.d_model, self.params.base)
        return encoding * self.params.scale
