"""The information-optimal encoding of the geometry paper: a FIXED matrix A = P_MDS.

A (max_positions × rank) holds the classical-MDS coordinates of the corpus's positional
distributions under the Hellinger metric (built by ``lab.geometry`` when training starts) and is
stored in the checkpoint as a buffer, never trained. It enters d_model by ZERO-PADDING (times a
fixed scale), not by a learned map: padding is an isometry, so the distances between position
vectors the model sees are exactly the corpus geometry the paper optimises (up to the scale).
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from model.positional.base import PositionalScheme


@dataclass(frozen=True)
class MdsParams:
    rank: int = 16
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"positional.rank must be ≥ 1, got {self.rank}")


class MdsPositions(PositionalScheme):
    name = "mds"
    kind = "added"
    claim = (
        "mds adds fixed coordinates per position from a table: an offset moves the "
        "prediction, and the table has a last row."
    )
    is_table = True
    Params = MdsParams
    coordinates: Tensor  # a buffer (register_buffer below), declared for the type checker

    def __init__(self, config, params: MdsParams) -> None:
        super().__init__(config, params)
        if params.rank > config.d_model:
            raise ValueError(
                f"positional.rank ({params.rank}) must be ≤ d_model ({config.d_model})"
            )
        # Placeholder until training fills in P_MDS of the corpus (any fixed matrix is valid).
        self.register_buffer("coordinates", torch.randn(config.max_positions, params.rank) * 0.02)

    def set_coordinates(self, coordinates: Tensor) -> None:
        """Install P_MDS [max_positions, r'] (r' ≤ rank; missing columns stay zero)."""
        rows, rank = coordinates.shape
        if rows != self.max_positions or rank > self.params.rank:
            raise ValueError(
                f"MDS coordinates of shape {tuple(coordinates.shape)} do not fit a table of "
                f"[{self.max_positions}, ≤{self.params.rank}]"
            )
        self.coordinates.zero_()
        self.coordinates[:, :rank] = coordinates.to(self.coordinates)

    def embedding(self, positions: Tensor) -> Tensor:
        self.check_positions(positions)
        padding = self.config.d_model - self.params.rank
        return (
            torch.nn.functional.pad(self.coordinates[positions], (0, padding)) * self.params.scale
        )
