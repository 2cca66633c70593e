"""T5's relative position bias: a learned scalar per head for each bucket of query−key distance.

Distances below num_buckets/2 get a bucket each; longer ones share log-spaced buckets up to
max_distance, and everything beyond shares the last bucket (so any length is accepted). Causal:
only distances ≥ 0 (keys at or before the query) matter. One table is shared by all layers.

Option: ``alibi_init`` s > 0 starts the table at ALiBi's bias with its slopes × s (each bucket at
its mean distance) instead of T5's near-zero random start: the locality prior that made alibi ×4
and FoX's half-closed gates the better starts on this corpus (checkpoints/README.md).
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from model.positional.alibi import alibi_slopes
from model.positional.base import PositionalScheme


@dataclass(frozen=True)
class T5Params:
    num_buckets: int = 32
    max_distance: int = 128
    alibi_init: float = 0.0  # > 0: the table starts at ALiBi's bias, slopes × this

    def __post_init__(self) -> None:
        if self.alibi_init < 0:
            raise ValueError(f"positional.alibi_init must be ≥ 0, got {self.alibi_init}")
        if self.num_buckets < 2:
            raise ValueError(f"positional.num_buckets must be ≥ 2, got {self.num_buckets}")
        if self.max_distance <= self.num_buckets // 2:
            raise ValueError(
                f"positional.max_distance ({self.max_distance}) must exceed num_buckets/2 "
                f"({self.num_buckets // 2})"
            )


def relative_position_bucket(
    distance: Tensor, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """Bucket index for each causal ``distance`` = query position − key position ≥ 0 → same shape.

    Negative distances (keys after the query, masked anyway) are treated as 0.
    """
    distance = distance.clamp(min=0)
    exact = num_buckets // 2
    # log-spaced buckets between `exact` and `max_distance`; clamp(min=1) only avoids log(0)
    # on the small distances that the `where` below discards anyway.
    log_ratio = torch.log(distance.clamp(min=1).float() / exact) / math.log(max_distance / exact)
    large = exact + (log_ratio * (num_buckets - exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return torch.where(distance < exact, distance, large)


def alibi_table(n_heads: int, params: T5Params) -> Tensor:
    """ALiBi's bias (slopes × ``params.alibi_init``) at each bucket's mean distance below
    max_distance → [num_buckets, n_heads]; a bucket no such distance reaches gets max_distance."""
    distance = torch.arange(params.max_distance)
    buckets = relative_position_bucket(distance, params.num_buckets, params.max_distance)
    total = torch.zeros(params.num_buckets).index_add_(0, buckets, distance.float())
    count = torch.zeros(params.num_buckets).index_add_(0, buckets, torch.ones(len(distance)))
    mean = torch.where(count > 0, total / count.clamp(min=1), float(params.max_distance))
    return -mean.unsqueeze(1) * alibi_slopes(n_heads) * params.alibi_init


class T5Positions(PositionalScheme):
    name = "t5"
    kind = "bias"
    claim = (
        "t5 adds a learned value per distance bucket: distances do not change with the "
        "offset, so nothing should move."
    )
    Params = T5Params

    def __init__(self, config, params: T5Params) -> None:
        super().__init__(config, params)
        if params.alibi_init > 0:
            start = alibi_table(config.n_heads, params)
        else:
            start = torch.randn(params.num_buckets, config.n_heads) * 0.02
        self.bias_table = nn.Parameter(start)

    def attention_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        distance = q_positions.unsqueeze(-1) - k_positions  # [B, Tq, Tk]
        buckets = relative_position_bucket(
            distance, self.params.num_buckets, self.params.max_distance
        )
        return self.bias_table[buckets].permute(0, 3, 1, 2)  # [B, H, Tq, Tk]
