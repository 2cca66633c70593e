"""One vector per position for every positional scheme, so all schemes can be measured alike.

REFERENCE.md ("Diagnostics of an encoding P"):
- additive schemes: the vector ``embedding(p)`` added to the token embedding;
- rope: R(p)·v for a fixed unit vector v, the per-head rotations concatenated;
- alibi and t5: row p of the attention-bias matrix (query p against keys 0..K−1), heads
  concatenated.
A scheme contributing more than one of these gets them concatenated; ``none`` contributes nothing
and has no representation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.positional.base import PositionalScheme


def _device(scheme: PositionalScheme) -> torch.device:
    tensors = [*scheme.parameters(), *scheme.buffers()]
    return tensors[0].device if tensors else torch.device("cpu")


def _rotated_unit_vectors(scheme: PositionalScheme, positions: Tensor) -> Tensor | None:
    """R(p)·v for v = (1, …, 1)/√d_model, every head's rotation applied to its slice of v.
    positions: [1, T] -> [T, d_model] (PoPE: [T, 2·d_model], each component's cos and sin
    parts), or None for schemes without a rotation."""
    if scheme.rotation(positions) is None:
        return None
    config = scheme.config
    length = positions.shape[1]
    # All-equal components give every rotation frequency the same weight, like sinusoidal.
    unit = torch.full((config.d_model,), config.d_model**-0.5, device=positions.device)
    heads = unit.view(1, config.n_heads, 1, config.head_dim).expand(-1, -1, length, -1)
    rotated = scheme.rotate(heads, positions)  # [1, H, T, head_dim (PoPE: twice it)]
    return rotated[0].permute(1, 0, 2).reshape(length, -1)


def encode_positions(scheme: PositionalScheme, positions: Tensor, keys: Tensor) -> Tensor | None:
    """The representation of each position in one sequence.

    positions: [T] long, the query positions.  keys: [K] long, the key positions the bias rows of
    alibi/t5 are taken against (unused by other schemes).
    Returns [T, width] float64 (width = d_model, or n_heads·K for bias schemes), or None if the
    scheme contributes nothing.  Raises PositionOutOfRange past a table's end.
    """
    positions = positions.to(_device(scheme)).reshape(1, -1)
    keys = keys.to(positions.device)
    parts = []
    with torch.no_grad():
        embedding = scheme.embedding(positions)
        if embedding is not None:
            parts.append(embedding[0])
        rotated = _rotated_unit_vectors(scheme, positions)
        if rotated is not None:
            parts.append(rotated)
        bias = scheme.attention_bias(positions, keys)  # [1, H, T, K]
        if bias is not None:
            parts.append(bias[0].permute(1, 0, 2).reshape(positions.shape[1], -1))
    if not parts:
        return None
    return torch.cat([part.to("cpu", torch.float64) for part in parts], dim=1)


def scheme_representation(
    scheme: PositionalScheme, n_positions: int, n_keys: int | None = None
) -> Tensor | None:
    """Representation of positions 0..n_positions−1 → [n_positions, width] float64, or None.

    n_keys: keys 0..n_keys−1 for bias schemes (default n_positions: a sequence of that length).
    """
    if n_positions < 1:
        raise ValueError(f"n_positions must be >= 1, got {n_positions}")
    keys = torch.arange(n_positions if n_keys is None else n_keys)
    return encode_positions(scheme, torch.arange(n_positions), keys)


def position_vectors(
    scheme: PositionalScheme, n_positions: int, n_keys: int | None = None
) -> Tensor:
    """scheme_representation, with a scheme that contributes nothing (``none``) placing every
    position at the same point, the origin: [n_positions, 1] zeros."""
    vectors = scheme_representation(scheme, n_positions, n_keys)
    return torch.zeros(n_positions, 1, dtype=torch.float64) if vectors is None else vectors
