"""Low-rank positional matrix P = A·Bᵀ, both factors trained: r·(n + d) parameters, not n·d.

The geometry paper's Remark 8: the optimal encoding has effective rank r = rank of the MDS Gram
matrix, so a rank-r factorisation can carry it. A can be initialised from P_MDS by training.
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from model.positional.base import PositionalScheme


@dataclass(frozen=True)
class LowRankParams:
    rank: int = 8

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"positional.rank must be ≥ 1, got {self.rank}")


class LowRankPositions(PositionalScheme):
    name = "lowrank"
    kind = "added"
    claim = (
        "lowrank adds a learned low-rank vector per position from a table: an offset moves "
        "the prediction, and the table has a last row."
    )
    is_table = True
    Params = LowRankParams

    def __init__(self, config, params: LowRankParams) -> None:
        super().__init__(config, params)
        # Scaled so each entry of A·Bᵀ starts near N(0, 0.02²), like a learned table.
        self.position_factor = nn.Parameter(torch.randn(config.max_positions, params.rank))
        self.model_factor = nn.Parameter(
            torch.randn(config.d_model, params.rank) * 0.02 / math.sqrt(params.rank)
        )

    def matrix(self) -> Tensor:
        """The full positional matrix P = A·Bᵀ → [max_positions, d_model]."""
        return self.position_factor @ self.model_factor.T

    def embedding(self, positions: Tensor) -> Tensor:
        self.check_positions(positions)
        return self.position_factor[positions] @ self.model_factor.T
