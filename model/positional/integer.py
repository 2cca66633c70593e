"""The seeds' naive baseline: the raw position p, times a scale, added to every dimension.

It is unbounded (the signal grows with p and swamps the token embedding), which is why it is
expected to train badly; it is here to be measured, not used.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from model.positional.base import PositionalScheme


@dataclass(frozen=True)
class IntegerParams:
    scale: float = 1.0


class IntegerPositions(PositionalScheme):
    name = "integer"
    kind = "added"
    claim = (
        "integer adds the position itself to every dimension: shifting it changes every "
        "vector, so the prediction moves."
    )
    Params = IntegerParams

    def embedding(self, positions: Tensor) -> Tensor:
        value = positions.to(torch.get_default_dtype()) * self.params.scale
        return value.unsqueeze(-1).expand(*positions.shape, self.config.d_model)
