"""A trainable table of max_positions vectors (GPT-2): flexible, but blind past its last row."""

import torch
from torch import Tensor, nn

from model.positional.base import PositionalScheme


class LearnedPositions(PositionalScheme):
    name = "learned"
    is_table = True

    def __init__(self, config, params) -> None:
        super().__init__(config, params)
        self.table = nn.Parameter(torch.randn(config.max_positions, config.d_model) * 0.02)

    def embedding(self, positions: Tensor) -> Tensor:
        self.check_positions(positions)
        return self.table[positions]
