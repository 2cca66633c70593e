"""Rotary position embedding (Su et al.), NeoX half-split layout.

Queries and keys are rotated by an angle proportional to their position, pair by pair, so the
score q_m · k_n depends on the content and on m − n only. Keys are rotated before they are cached.

Options: ``rotary_fraction`` rotates only the first fraction of each head's dimensions (the rest
pass through, as in GPT-NeoX). ``fraction`` keeps that share of the rotation frequencies, the
highest first, and turns the pairs of the lowest ones by nothing (p-RoPE, Barbero et al. ICLR
2025; 0.75 is their 0.75-RoPE, 1 is rope itself): unlike ``rotary_fraction``, which spreads the
base's whole range of frequencies over fewer dimensions, it keeps rope's own frequencies and
drops the slowest, whose angles stay small over the trained length. ``scaling`` with
``scaling_factor`` s stretches the trained range (``original_context``, default the config's
context_length L) to serve longer contexts, and is meant to be set at load time — on the same
weights (served as e.g. ``rope+yarn4``):

- ``linear``: position interpolation (Chen et al. 2023): positions ÷ s.
- ``ntk``: NTK-aware scaling: base × s^(d/(d−2)) — the highest frequency kept, the lowest
  interpolated.
- ``dynamic``: NTK with s grown to the current length n, as Hugging Face's ``dynamic`` rope type:
  base × ((s·n/L) − (s − 1))^(d/(d−2)) once n > L, the trained base below. As there, keys
  already cached keep the rotation they were cached with.
- ``yarn`` (Peng et al. 2023): per pair, a ramp between interpolation (frequency ÷ s) for pairs
  that turn fewer than ``beta_slow`` times over L and extrapolation (unchanged) for those that
  turn more than ``beta_fast`` times; cos and sin scaled by the attention temperature
  0.1·ln s + 1 (so q·k by its square), as Hugging Face's ``yarn``.
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from model.positional.base import PositionalScheme, capturing, positions_table
from model.positional.rotation import Rotation
from model.positional.sinusoidal import position_angles

SCALINGS = (None, "linear", "ntk", "dynamic", "yarn")


@dataclass(frozen=True)
class RopeParams:
    base: float = 10000.0
    rotary_fraction: float = 1.0
    fraction: float = 1.0  # p-RoPE: the share of frequency pairs kept, highest first
    scaling: str | None = None
    scaling_factor: float = 1.0
    original_context: int | None = None  # the trained length the scaling starts from (None: L)
    beta_fast: float = 32.0  # yarn: pairs turning more often than this over L extrapolate
    beta_slow: float = 1.0  # yarn: pairs turning less often than this over L interpolate

    def __post_init__(self) -> None:
        if not 0.0 < self.rotary_fraction <= 1.0:
            raise ValueError(
                f"positional.rotary_fraction must be in (0, 1], got {self.rotary_fraction}"
            )
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"positional.fraction must be in (0, 1], got {self.fraction}")
        if self.scaling not in SCALINGS:
            raise ValueError(
                f"positional.scaling must be one of {list(SCALINGS)}, got {self.scaling!r}"
            )
        if self.scaling_factor < 1.0:
            raise ValueError(f"positional.scaling_factor must be ≥ 1, got {self.scaling_factor}")
        if self.original_context is not None and self.original_context < 1:
            raise ValueError(
                f"positional.original_context must be ≥ 1, got {self.original_context}"
            )
        if not 0 < self.beta_slow < self.beta_fast:
            raise ValueError(
                f"positional.beta_slow ({self.beta_slow}) must be > 0 and below beta_fast "
                f"({self.beta_fast})"
            )


def rope_angles(positions: Tensor, rotary_dim: int, base: float = 10000.0) -> Rotation:
    """cos/sin tables for ``positions`` [...] → each [..., rotary_dim] (NeoX half-split layout).

    cos and sin are taken of the float64 angles and only then rounded to float32: rounding the
    angles first would put an error of ~m·θ·6e-8 on them (1e-4 rad at position 10,000).
    """
    angles = position_angles(positions, rotary_dim, base)  # [..., rot/2], float64
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((cos, cos), dim=-1).float(), torch.cat((sin, sin), dim=-1).float()


def ntk_base(base: float, factor: float, rotary_dim: int) -> float:
    """NTK-aware scaling's base: base × factor^(d/(d−2)). A single pair has only the highest
    frequency (base⁰ = 1), so there is nothing to stretch."""
    return base * factor ** (rotary_dim / (rotary_dim - 2)) if rotary_dim > 2 else base


def yarn_inverse_frequencies(
    rotary_dim: int, base: float, factor: float, original: int, beta_fast: float, beta_slow: float
) -> Tensor:
    """YaRN's frequency per pair → [rotary_dim/2] float64 (Hugging Face's
    ``_compute_yarn_parameters``): pairs below the ``beta_fast`` correction dimension keep their
    frequency, pairs past the ``beta_slow`` one are divided by ``factor``, a linear ramp between."""

    def correction_dim(rotations: float) -> float:  # the pair that turns `rotations` times over L
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(beta_slow)), rotary_dim - 1)
    if low == high:
        high += 0.001  # a ramp of width zero would divide by zero
    pair = torch.arange(rotary_dim // 2, dtype=torch.float64)
    extrapolated = base ** (-2 * pair / rotary_dim)
    ramp = ((pair - low) / (high - low)).clamp(0, 1)  # 0: extrapolate, 1: interpolate
    return extrapolated * (1 - ramp) + extrapolated / factor * ramp


def yarn_attention_factor(factor: float) -> float:
    """YaRN's attention temperature 0.1·ln s + 1 (1 for s ≤ 1), applied to cos and sin."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


class RotaryPositions(PositionalScheme):
    name = "rope"
    kind = "rotation"
    claim = (
        "rope rotates queries and keys by their positions, and a dot product of two "
        "rotations depends only on their difference: the offset should change nothing (up to "
        "rounding)."
    )
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
        # p-RoPE: the pairs 0..kept_pairs−1 turn (the fastest), the others stay where they are.
        self.kept_pairs = int(params.fraction * rotary_dim // 2)
        if self.kept_pairs < 1:
            raise ValueError(
                f"positional.fraction={params.fraction} keeps no frequency of the "
                f"{rotary_dim // 2} pairs a head of {config.head_dim} dims rotates"
            )
        self.base = params.base
        self.position_divisor = 1.0
        self.original_context = params.original_context or config.context_length
        if params.scaling == "linear":  # position interpolation: squeeze positions into range
            self.position_divisor = params.scaling_factor
        elif params.scaling == "ntk":  # stretch the low frequencies, keep the highest
            self.base = ntk_base(params.base, params.scaling_factor, rotary_dim)

        self._table: Rotation | None = None  # cos/sin per position, grown on demand
        self._table_length = 0  # dynamic: the sequence length the table's base was chosen for

    @property
    def prefix_stable(self) -> bool:
        # dynamic chooses its base from the longest position of the pass, so keys cached by a
        # longer pass were rotated otherwise than a new pass would rotate them
        return self.params.scaling != "dynamic"

    def rotation(self, positions: Tensor) -> Rotation:
        # A decode step looks its positions up in one cos/sin table instead of recomputing the
        # angles (which cost rope a fifth of a small model's per-token time).
        # While a step is captured its table was reserved (and reading positions would sync).
        needed = int(positions.max()) + 1 if positions.numel() and not capturing(positions) else 0
        table = self._table
        length = 0 if table is None else table[0].shape[0]
        stale = (
            self.params.scaling == "dynamic" and self._dynamic_length(needed) != self._table_length
        )
        if stale or length < needed or table is None or table[0].device != positions.device:
            # A table too short doubles, so a sequence growing a position a step rebuilds it
            # O(log n) times. One rebuilt at its length (dynamic's base moved, another device)
            # keeps that length: dynamic past L rebuilds every step, and doubling there made a
            # table of 2^k·L rows at the k-th step past L (2^25·128 rows: the engine hung).
            kept = 2 * length if length < needed else length
            size = max(needed, self.config.context_length, kept)
            table = self._table = self._build_table(size, needed, positions.device)
        cos, sin = table  # [N, rot]
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [B, 1, T, rot]

    def reserve(self, n_positions: int, device: torch.device) -> tuple[Tensor, ...]:
        self.rotation(positions_table(n_positions, device))
        assert self._table is not None  # built by rotation()
        return self._table

    def _dynamic_length(self, needed: int) -> int:
        """The length dynamic NTK scales for: the current one past L, else L (the trained base)."""
        return max(needed, self.original_context)

    def _build_table(self, size: int, needed: int, device: torch.device) -> Rotation:
        """cos/sin [size, rot] for positions 0..size-1 under this scheme's scaling, the pairs
        past ``kept_pairs`` turned by 0 (cos 1, sin 0: they pass unchanged)."""
        cos, sin = self._scaled_table(size, needed, device)
        if self.kept_pairs < self.rotary_dim // 2:
            half = self.rotary_dim // 2
            dropped = (torch.arange(self.rotary_dim, device=device) % half) >= self.kept_pairs
            cos, sin = cos.masked_fill(dropped, 1.0), sin.masked_fill(dropped, 0.0)
        return cos, sin

    def _scaled_table(self, size: int, needed: int, device: torch.device) -> Rotation:
        """cos/sin [size, rot] for positions 0..size-1 under this scheme's scaling."""
        params = self.params
        # float64 like the angles: m / s rounded to float32 would be off by 1e-4 at 10,000
        grid = torch.arange(size, device=device, dtype=torch.float64) / self.position_divisor
        if params.scaling == "dynamic":
            self._table_length = length = self._dynamic_length(needed)
            stretch = params.scaling_factor * length / self.original_context
            factor = stretch - (params.scaling_factor - 1)
            return rope_angles(grid, self.rotary_dim, ntk_base(self.base, factor, self.rotary_dim))
        if params.scaling == "yarn":
            frequencies = yarn_inverse_frequencies(
                self.rotary_dim,
                self.base,
                params.scaling_factor,
                self.original_context,
                params.beta_fast,
                params.beta_slow,
            ).to(device)
            angles = grid.unsqueeze(-1) * frequencies
            scale = yarn_attention_factor(params.scaling_factor)
            cos, sin = angles.cos() * scale, angles.sin() * scale
            return torch.cat((cos, cos), dim=-1).float(), torch.cat((sin, sin), dim=-1).float()
        return rope_angles(grid, self.rotary_dim, self.base)
