"""PoPE, polar coordinate position embeddings (Gopalakrishnan et al., 2025): what a component
says and where it is, kept apart.

Each of a head's d query and key components becomes a complex number: its magnitude is
softplus of the component (the "what", never negative, so it cannot flip a phase) and its phase
is the position times that component's own frequency θ_c = base^(−c/d) (the "where": d
frequencies where rope has d/2 pairs), plus, for keys, a learned phase bias δ (one per layer,
key head and component) kept in [−2π, 0]. The score is the real part of their product:

    score(s, t) = Σ_c softplus(q_c) · softplus(k_c) · cos((s − t)·θ_c − δ_c) / √d,

which depends on the positions through s − t only. It is computed by writing each complex
number as its (cos, sin) parts, so queries and keys (and the cached keys) are twice rope's
width; values are not. With δ = 0 and softplus replaced by |x| it is the closed form above with
|q_c|·|k_c| (the tests check both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.positional.base import PositionalScheme
from model.positional.rotation import Rotation


@dataclass(frozen=True)
class PopeParams:
    base: float = 10000.0

    def __post_init__(self) -> None:
        if self.base <= 1:
            raise ValueError(f"positional.base must be > 1, got {self.base}")


class PolarPositions(PositionalScheme):
    name = "pope"
    kind = "rotation"
    claim = (
        "pope turns each component's phase by its position and keeps its magnitude apart: a "
        "score depends on the distance only, so the offset changes nothing."
    )
    Params = PopeParams
    # Its keys are twice a head's width, which the decode kernel's cache layout is not.
    kernel_bias = None
    key_width_factor = 2
    frequencies: Tensor  # [hd] θ_c, float64

    def __init__(self, config, params: PopeParams) -> None:
        super().__init__(config, params)
        head_dim = config.head_dim
        exponents = torch.arange(head_dim, dtype=torch.float64) / head_dim
        # float64 whatever the model's dtype (a buffer would follow .to()), as rope's angles are
        self.frequencies = params.base ** (-exponents)
        # δ per layer, key head and component, zero at the start: the paper's initialisation
        self.phase_bias = nn.Parameter(
            torch.zeros(config.n_layers, config.key_value_heads, head_dim)
        )
        self.magnitude = F.softplus

    def rotation(self, positions: Tensor) -> Rotation:
        """cos/sin of each component's angle p·θ_c at ``positions`` [B, T] → [B, 1, T, hd]."""
        frequencies = self.frequencies.to(positions.device)
        angles = positions.unsqueeze(-1).to(torch.float64) * frequencies  # [B, T, hd]
        return angles.cos().float().unsqueeze(1), angles.sin().float().unsqueeze(1)

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """Each component of ``x`` [B, H, T, hd] turned to its phase at ``positions`` [B, T],
        with no magnitude map or phase bias: the position alone → [B, H, T, 2·hd] (cos parts,
        then sin parts), whose dot products are Σ_c x_c·y_c·cos((s − t)·θ_c)."""
        cos, sin = (part.to(x.dtype) for part in self.rotation(positions))
        return torch.cat([x * cos, x * sin], dim=-1)

    def turn(self, queries_keys: Tensor, rotation: Rotation, n_heads: int, layer: int) -> Tensor:
        """[B, H + Hkv, T, hd] → [B, H + Hkv, T, 2·hd]: each component as the (cos, sin) parts
        of its magnitude at its phase, keys' phases moved by δ; queries × √2, so that SDPA's
        1/√(2·hd) scales the score by 1/√hd as the definition does."""
        cos, sin = (part.to(queries_keys.dtype) for part in rotation)
        magnitude = self.magnitude(queries_keys)
        queries, keys = magnitude.split([n_heads, magnitude.shape[1] - n_heads], dim=1)
        delta = self.phase_bias[layer].clamp(-2 * math.pi, 0.0)[None, :, None, :]  # [1, Hkv, 1, hd]
        key_cos = cos * delta.cos() - sin * delta.sin()  # cos(tθ + δ)
        key_sin = sin * delta.cos() + cos * delta.sin()  # sin(tθ + δ)
        turned_queries = torch.cat([queries * cos, queries * sin], dim=-1) * math.sqrt(2)
        turned_keys = torch.cat([keys * key_cos, keys * key_sin], dim=-1)
        return torch.cat([turned_queries, turned_keys.to(turned_queries.dtype)], dim=1)
