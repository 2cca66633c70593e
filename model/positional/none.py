"""NoPE: no positional signal at all. Causal attention still breaks permutation symmetry."""

from model.positional.base import PositionalScheme


class NoPositions(PositionalScheme):
    name = "none"
