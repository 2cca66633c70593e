"""Rotary position embedding (Su et al.), NeoX half-split layout.

Queries and keys are rotated by an angle proportional to their position, pair by pair, so the
score q_m · k_n depends on the content and on m − n only. Keys are rotated before they are cached.

Options: ``rotary_fraction`` rotates only the first fraction of each head's dimensions (the rest
pass through, as in GPT-NeoX); ``scaling`` ("linear" or "ntk") with ``scaling_factor`` stretches
the trained range to serve longer contexts and is meant to be set at load time.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from model.positional.base import PositionalScheme, Rotation
from model.positional.sinusoidal import position_angles

SCALINGS = (None, "linear", "ntk")


@dataclass(frozen=True)
class RopeParams:
    base: float = 10000.0
    rotary_fraction: float = 1.0
    scaling: str | None = None
    scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 < self.rotary_fraction <= 1.0:
            raise ValueError(
                f"positional.rotary_fraction must be in (0, 1], got {self.rotary_fraction}"
            )
        if self.scaling not in SCALINGS:
            raise ValueError(
                f"positional.scaling must be one of {list(SCALINGS)}, got {self.scaling!r}"
            )
        if self.scaling_factor < 1.0:
            raise ValueError(f"positional.scaling_factor must be ≥ 1, got {self.scaling_factor}")


def rope_angles(positions: Tensor, rotary_dim: int, base: float = 10000.0) -> Rotation:
    """cos/sin tables for ``positions`` [...] → each [..., rotary_dim] (NeoX half-split layout).

    cos and sin are taken of the float64 angles and only then rounded to float32: rounding the
    angles first would put an error of ~m·θ·6e-8 on them (1e-4 rad at position 10,000).
    """
    angles = position_angles(positions, rotary_dim, base)  # [..., rot/2], float64
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), dim=-1).float(), torch.cat((sin, sin), dim=-1).float()


def apply_rotation(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` [..., T, head_dim]; the rest pass through.

    ``cos``/``sin`` [..., T, rot] broadcast against ``x``'s leading dims.
    """
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = rotated.chunk(2, dim=-1)
    rotated_half = torch.cat((-second, first), dim=-1)
    out = rotated * cos.to(x.dtype) + rotated_half * sin.to(x.dtype)
    return torch.cat((out, passed), dim=-1) if passed.shape[-1] else out


def apply_rope(x: Tensor, positions: Tensor, base: float = 10000.0) -> Tensor:
    """Rotate every dim of ``x`` [..., T, head_dim] at ``positions`` (broadcastable to [..., T])."""
    return apply_rotation(x, *rope_angles(positions, x.shape[-1], base))


class RotaryPositions(PositionalScheme):
    name = "rope"
    Params = RopeParams

    def __init__(self, config, params: RopeParams) -> None:
        super().__init__(config, params)
        rotary_dim = int(config.head_dim * params.rotary_fraction) // 2 * 2
        if rotary_dim < 2:
            raise ValueError(
                f"positional.rotary_fraction={params.rotary_fraction} leaves no dimension pair "
                f"to rotate in a head of {config.head_dim} dims"
            )
        self.rotary_dim = rotary_dim
        self.base = params.base
        self.position_divisor = 1.0
        if params.scaling == "linear":  # position interpolation: squeeze positions into range
            self.position_divisor = params.scaling_factor
        elif params.scaling == "ntk" and rotary_dim > 2:
            # NTK-aware: stretch the low frequencies, keep the highest. A single pair has only
            # the highest frequency (base**0 = 1), so there is nothing to stretch.
            self.base = params.base * params.scaling_factor ** (rotary_dim / (rotary_dim - 2))

        self._table: Rotation | None = None  # cos/sin per position, grown on demand

    def rotation(self, positions: Tensor) -> Rotation:
        # A decode step looks its positions up in one cos/sin table instead of recomputing the
        # angles (which cost rope a fifth of a small model's per-token time).
        needed = int(positions.max()) + 1 if positions.numel() else 0
        table = self._table
        if table is None or table[0].shape[0] < needed or table[0].device != positions.device:
            size = max(needed, self.config.context_length, 2 * (table[0].shape[0] if table else 0))
            # float64 like the angles: m / s rounded to float32 would be off by 1e-4 at 10,000
            grid = torch.arange(size, device=positions.device, dtype=torch.float64)
            grid = grid / self.position_divisor
            table = self._table = rope_angles(grid, self.rotary_dim, self.base)
        cos, sin = table  # [N, rot]
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [B, 1, T, rot]
