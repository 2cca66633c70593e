"""Binary encoding: bit k of the position in dimension k (0/1, times a scale), other dims 0.

Bounded and unique up to 2**bits positions; past that the pattern would wrap around, so those
positions are refused rather than silently aliased. Adjacent positions can differ in every bit
(7 → 8), which is why it is not smooth.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from model.positional.base import PositionalScheme


@dataclass(frozen=True)
class BinaryParams:
    bits: int = 16
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.bits <= 62:
            raise ValueError(f"positional.bits must be in 1..62, got {self.bits}")


class BinaryPositions(PositionalScheme):
    name = "binary"
    kind = "added"
    claim = (
        "binary adds the position's bits: shifted positions have different bits, so the "
        "prediction moves."
    )
    Params = BinaryParams
    powers: Tensor  # a buffer (register_buffer below), declared for the type checker

    def __init__(self, config, params: BinaryParams) -> None:
        super().__init__(config, params)
        if params.bits > config.d_model:
            raise ValueError(
                f"positional.bits ({params.bits}) must be ≤ d_model ({config.d_model})"
            )
        self.max_positions = 2**params.bits
        self.register_buffer("powers", 2 ** torch.arange(params.bits), persistent=False)

    def embedding(self, positions: Tensor) -> Tensor:
        self.check_positions(positions)
        bits = (positions.unsqueeze(-1) // self.powers) % 2  # [B, T, bits]
        padding = self.config.d_model - self.params.bits
        vector = torch.nn.functional.pad(bits.to(torch.get_default_dtype()), (0, padding))
        return vector * self.params.scale
