"""ALiBi (Press et al.): a linear penalty −m_h · (i − j) on the score of query i for key j.

Each head h has its own slope m_h; no vector is added anywhere, so any length is accepted.
Option: ``scale`` multiplies every slope (the paper's sequence times ``scale``): above 1 every
head looks more locally, as FoX's learned gates do on this corpus (checkpoints/README.md).
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from model.positional.base import PositionalScheme


@dataclass(frozen=True)
class AlibiParams:
    scale: float = 1.0  # multiplies the paper's slopes

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"positional.scale must be > 0, got {self.scale}")


def alibi_slopes(n_heads: int) -> Tensor:
    """The per-head slopes → [n_heads].

    For a power of two n: the geometric sequence 2^(-8/n), 2^(-16/n), …, 2^(-8). Otherwise, as in
    the paper's code: the slopes of the closest smaller power of two, then every other slope of
    twice that power, until there are n.
    """
    if n_heads < 1:
        raise ValueError(f"n_heads must be ≥ 1, got {n_heads}")

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two_slopes(closest)
    if closest < n_heads:
        slopes += power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


class AlibiPositions(PositionalScheme):
    name = "alibi"
    kind = "bias"
    claim = (
        "alibi subtracts slope × distance from each score: distances do not change with the "
        "offset, so nothing should move."
    )
    Params = AlibiParams
    slopes: Tensor  # a buffer (register_buffer below), declared for the type checker

    def __init__(self, config, params: AlibiParams) -> None:
        super().__init__(config, params)
        slopes = alibi_slopes(config.n_heads) * params.scale
        self.register_buffer("slopes", slopes.view(1, -1, 1, 1), persistent=False)

    def attention_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        # Only one row of distances per query: O(Tq · Tk) work, never a cached T×T matrix.
        distance = q_positions.unsqueeze(-1) - k_positions  # [B, Tq, Tk]
        return -self.slopes * distance.unsqueeze(1).to(self.slopes.dtype)
