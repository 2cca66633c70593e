"""FIRE, functional interpolation for relative positions (Li et al., ICLR 2024).

The score of query i for key j gets b_h(i, j) = f_θ(ψ(i − j) / ψ(max(L, i)))_h: a small MLP
f_θ (1 → ``hidden`` ReLU units → one output per head, shared by all layers) of the log-scaled
distance ψ(x) = log(c·x + 1), divided by that of the query's own position, so every input lies in
[0, 1] whatever the length ("progressive interpolation"). L, a learned threshold, keeps the
divisor from shrinking for early queries; c is learned too. Both are as in the paper's code:
c starts at 0.1 and L at ``threshold`` × a learned multiplier starting at 1 (the paper's 512 for
its 2048-token training length; here a quarter of the trained length unless set).

``log_transform=False`` makes ψ the identity and ``normalise=False`` drops the division, so the
MLP reads the raw distance i − j: then a one-unit MLP is ALiBi's −m_h·(i − j), and a pair of
units per bucket boundary is T5's bucketed table (tests/model/test_fox_cope_fire.py builds both).
"""

from dataclasses import dataclass

import torch
from torch import Tensor, nn

import model.kernels as kernels
from model.positional.base import PositionalScheme

EPSILON = 1e-6  # keeps the divisor ψ(max(L, i)) away from 0 (the paper's eps)


@dataclass(frozen=True)
class FireParams:
    hidden: int = 32  # the MLP's width (the paper's 32)
    c: float = 0.1  # the initial c of ψ(x) = log(c·x + 1)
    threshold: float | None = None  # the initial L (None: a quarter of the context length)
    log_transform: bool = True  # False: ψ(x) = x
    normalise: bool = True  # False: the MLP reads ψ(i − j) itself

    def __post_init__(self) -> None:
        if self.hidden < 1:
            raise ValueError(f"positional.hidden must be ≥ 1, got {self.hidden}")
        if self.c <= 0:
            raise ValueError(f"positional.c must be positive, got {self.c}")
        if self.threshold is not None and self.threshold <= 0:
            raise ValueError(f"positional.threshold must be positive, got {self.threshold}")


class FirePositions(PositionalScheme):
    name = "fire"
    kind = "bias"
    claim = (
        "fire adds a learned function of the log distance over the log of the query's "
        "position, floored at a learned threshold: an offset changes nothing while every "
        "query stays below that threshold, and moves the prediction once it takes them past."
    )
    Params = FireParams

    def __init__(self, config, params: FireParams) -> None:
        super().__init__(config, params)
        self.mlp_in = nn.Linear(1, params.hidden)
        self.mlp_out = nn.Linear(params.hidden, config.n_heads)
        self.c = nn.Parameter(torch.tensor(params.c))
        self.threshold = params.threshold or config.context_length / 4
        self.threshold_scale = nn.Parameter(torch.tensor(1.0))

    def psi(self, x: Tensor) -> Tensor:
        """ψ(x) = log(|c|·x + 1) (or x itself without the log transform); x ≥ 0."""
        return torch.log(self.c.abs() * x + 1) if self.params.log_transform else x

    def interpolated_distance(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        """The MLP's input ψ(i − j) / ψ(max(L, i)) → [B, Tq, Tk] (float32)."""
        q = q_positions.unsqueeze(-1).float()  # [B, Tq, 1]
        distance = self.psi((q - k_positions.float()).clamp(min=0))  # later keys: masked anyway
        if not self.params.normalise:
            return distance
        threshold = (self.threshold_scale * self.threshold).abs()
        return distance / (self.psi(torch.maximum(q, threshold)) + EPSILON)

    def attention_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        inputs = self.interpolated_distance(q_positions, k_positions).unsqueeze(-1)
        hidden = torch.relu(self.mlp_in(inputs.to(self.mlp_in.weight.dtype)))
        return self.mlp_out(hidden).permute(0, 3, 1, 2)  # [B, Tq, Tk, H] → [B, H, Tq, Tk]

    def kernel_score_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        """The bias of one query per row [B, 1] → [B, H, 1, Tk] from the kernels' ``fire_bias``:
        the MLP over every key is ~17 small torch operations a step, each a dispatch."""
        ops = kernels.ops()
        if ops is None:
            return self.attention_bias(q_positions, k_positions)
        threshold = self.threshold_scale * self.threshold
        bias: Tensor = ops.fire_bias(
            q_positions[:, 0],
            k_positions.shape[0],
            self.mlp_in.weight.view(-1),
            self.mlp_in.bias,
            self.mlp_out.weight.contiguous(),
            self.mlp_out.bias,
            float(self.c.abs()),
            float(threshold.abs()),
            self.params.log_transform,
            self.params.normalise,
        )
        return bias.unsqueeze(2)
