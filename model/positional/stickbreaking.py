"""Stick-breaking attention (Tan et al., ICLR 2025): no positional encoding, and no softmax.

Each query breaks a stick of length 1 from its own key backwards: key j takes the share
β_ij = σ(q_i·k_j/√d) of what the keys after it left,

    A_ij = β_ij · ∏_{j<t≤i} (1 − β_it),

so a key is outweighed by every later key that claims its share first: recency comes from the
process, with no position anywhere. A row's weights sum to at most 1 (what is left of the stick
goes to no value). Computed in log space, log A_ij = log σ(z_ij) + Σ_{j<t≤i} log σ(−z_it), the
sum running from the query's own key back, so keys cached or unwritten past the query add
nothing (the same running sum as FoX's forgetting). The current token's own key takes the
first share (flash-linear-attention's ``attend_current=True``).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from model.positional.base import PositionalScheme, sum_back_to_each_key


class StickBreakingPositions(PositionalScheme):
    name = "stickbreaking"
    kind = "weights"
    claim = (
        "stick-breaking's only positional signal is the order its process reads the keys in: "
        "the offset changes nothing, and dropping it (softmax over the same scores) changes "
        "everything."
    )
    replaces_softmax = True

    def attention_weights(self, scores: Tensor, allowed: Tensor) -> Tensor:
        scores = scores.float()
        kept = F.logsigmoid(-scores)  # log(1 − β): what each later key leaves of the stick
        later = sum_back_to_each_key(kept, allowed) - kept.where(allowed, 0.0)
        weights = (F.logsigmoid(scores) + later).exp()
        return weights.where(allowed, 0.0)
