"""NoPE: no positional signal at all. Causal attention still breaks permutation symmetry."""

from model.positional.base import PositionalScheme


class NoPositions(PositionalScheme):
    name = "none"
    kind = "none"
    claim = (
        "none has no positional signal at all: the offset cannot change anything, and "
        "removing it removes nothing."
    )
