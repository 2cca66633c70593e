"""A trainable table of max_positions vectors (GPT-2): flexible, but blind past its last row."""

import torch
from torch import Tensor, nn

from model.positional.base import PositionalScheme


class LearnedPositions(PositionalScheme):
    name = "learned"
    kind = "added"
    claim = (
        "learned adds a trained vector per position, and stops at its table's last row: an "
        "offset moves the prediction, and past the table there is nothing to add (the server "
        "says so)."
    )
    is_table = True

    def __init__(self, config, params) -> None:
        super().__init__(config, params)
        self.table = nn.Parameter(torch.randn(config.max_positions, config.d_model) * 0.02)

    def embedding(self, positions: Tensor) -> Tensor:
        self.check_positions(positions)
        return self.table[positions]
