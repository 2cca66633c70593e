"""PaTH, position encoding by accumulated Householder transformations (Yang et al., NeurIPS
2025): what lies between a key and its query turns the key, not how far apart they are.

Each token t brings, per head, a unit direction w_t and a strength β_t = 2·σ(u·x_t + b) ∈ (0, 2),
both computed from the layer's input x_t, and with them the transition H_t = I − β_t·w_t·w_tᵀ
(a Householder reflection at β = 2, the identity at β = 0). Query i scores key j ≤ i as

    score(i, j) = q_iᵀ · H_i · H_{i−1} ⋯ H_{j+1} · k_j / √d,

so RoPE's fixed rotation by i − j becomes a product chosen by the tokens in between. Nothing
depends on a position, so any length is accepted and moving the prompt changes nothing.

Computed without forming any d × d matrix, for a pass of n new tokens after keys k̂_j that already
carry the transitions of every earlier token (the KV cache keeps them so, and a full forward
starts with none). The pass takes its tokens in blocks of ``BLOCK`` (the paper's chunks). A
block's effect on key j is Σ_s w_s·U[s, j] over its tokens s, where U solves

    (I + D·strictly_lower(W·Wᵀ)) · U = D · (W·K̂ᵀ masked to j before s),    D = diag(β),

a unit lower-triangular system of one block's rows (the paper's UT transform), solved by
substitution (in training, inverted by doubling blocks: ``unit_lower_inverse``). Query i scores
the keys as the blocks before its own left them, less Σ_{s ≤ i} (q_i·w_s)·U[s, j] over its own
block's tokens; then the keys become k̂_j − Σ_s w_s·U[s, j] for the next block. After the pass
the cache writes the keys back in place of what it held (the paper's §3.4), so that the next
pass starts from keys carrying every transition so far. A prefix kept from another request would
lack the transitions that came after it, so PaTH is not ``prefix_stable``: no prefix cache, no
speculative drafts, no captured steps.

PaTH-FoX (``pathfox``) adds FoX's forget gates to the same scores (fox.py): the paper's best
model at long context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.positional.base import LayerBias, MovedKeys, PositionalScheme
from model.positional.fox import ForgettingPositions, FoxParams


@dataclass(frozen=True)
class PathParams:
    # The strengths' bias at initialisation: 0 starts every β at 1 (the paper's σ·2 at 0).
    beta_bias_init: float = 0.0


# Tokens per block of a pass: the size of each triangular system. A pass of n tokens costs
# O(n·T·(d + BLOCK)) in blocks, where one system of n rows costs O(n²·T).
BLOCK = 32


def unit_lower_inverse(system: Tensor) -> Tensor:
    """The inverse of unit lower-triangular ``system`` [..., c, c], in float32, by doubling
    blocks: the inverse of [[A, 0], [C, B]] is [[A⁻¹, 0], [−B⁻¹·C·A⁻¹, B⁻¹]], so the inverses
    of the 1 × 1 diagonal blocks (1) make those of the 2 × 2, then 4 × 4, … — substitution done
    a level at a time in batched products, where a triangular solve is a call per matrix."""
    size = system.shape[-1]
    padded = 1 << (size - 1).bit_length()  # identity below and right of it up to a power of 2
    with torch.autocast(system.device.type, enabled=False):
        padding = torch.arange(padded, device=system.device) >= size
        system = F.pad(system.float(), (0, padded - size, 0, padded - size)) + torch.diag(
            padding.float()
        )
        *batch, _, _ = system.shape
        blocks = system.new_ones(*batch, padded, 1, 1)  # the inverses of the diagonal blocks
        span = 1
        while span < padded:
            count = padded // (2 * span)
            pairs = system.view(*batch, count, 2 * span, count, 2 * span)
            pairs = pairs.diagonal(dim1=-4, dim2=-2).movedim(-1, -3)  # [..., count, 2s, 2s]
            first, second = blocks[..., 0::2, :, :], blocks[..., 1::2, :, :]
            corner = -(second @ pairs[..., span:, :span] @ first)
            top = torch.cat([first, torch.zeros_like(first)], dim=-1)
            blocks = torch.cat([top, torch.cat([corner, second], dim=-1)], dim=-2)
            span *= 2
        return blocks[..., 0, :size, :size]


def householder_pass(
    queries: Tensor,
    keys: Tensor,
    directions: Tensor,
    strengths: Tensor,
    before: Tensor,
) -> MovedKeys:
    """The transitions of a pass's new tokens, applied to its scores and its keys.

    ``queries`` [B, H, n, hd] of the new tokens; ``keys`` [B, H, Tk, hd] every key they may see
    as the cache holds it (the new tokens' own raw); ``directions`` [B, H, n, hd] unit w_s and
    ``strengths`` [B, H, n] β_s of the new tokens (0 on padding); ``before`` [B|1, 1, n, Tk]
    bool, True where key j comes before new token s. → the score bias [B, H, n, Tk] on
    q·k/√hd, and the keys after the pass [B, H, Tk, hd]. In float32 (under training's
    autocast the products run in bfloat16, as the step's other products do).
    """
    dtype, device = queries.dtype, queries.device
    queries, keys, directions = queries.float(), keys.float(), directions.float()
    beta = strengths.float().unsqueeze(-1)  # [B, H, n, 1]
    moved, biases = keys, []
    for start in range(0, directions.shape[-2], BLOCK):
        block = slice(start, start + BLOCK)
        w, b, q = directions[..., block, :], beta[..., block, :], queries[..., block, :]
        size = w.shape[-2]
        right = (b * (w @ moved.transpose(-2, -1))).masked_fill(~before[..., block, :], 0.0)
        shares, reach = right, q @ w.transpose(-2, -1)  # one token (a decode step): system I
        if size > 1:
            lower = torch.ones(size, size, dtype=torch.bool, device=device)
            between = (b * (w @ w.transpose(-2, -1))).masked_fill(~lower.tril(-1), 0.0)
            system = torch.eye(size, device=device) + between
            if system.requires_grad:  # training: a solve's backward is two more solves
                shares = unit_lower_inverse(system) @ right
            else:  # without gradients one solve is the fewest calls
                shares = torch.linalg.solve_triangular(
                    system, right, upper=False, unitriangular=True
                )
            reach = reach.masked_fill(~lower.tril(), 0.0)  # s ≤ i
        bias = -(reach @ shares)
        if start > 0:  # what the earlier blocks did to the keys this block's queries see
            bias = bias + q @ (moved - keys).transpose(-2, -1)
        biases.append(bias)
        moved = moved - shares.transpose(-2, -1) @ w
    bias = torch.cat(biases, dim=-2) / math.sqrt(queries.shape[-1])
    return MovedKeys(bias.to(dtype), moved.to(dtype))


class PathPositions(PositionalScheme):
    name = "path"
    kind = "data-dependent"
    claim = (
        "path turns each key by the Householder transitions of the tokens after it, chosen by "
        "those tokens, never by a position: the offset should change nothing (up to rounding)."
    )
    Params = PathParams
    data_dependent = True
    rewrites_keys = True

    def __init__(self, config, params: PathParams) -> None:
        super().__init__(config, params)
        layers, heads, head_dim = config.n_layers, config.n_heads, config.head_dim
        # Per layer: a direction per head [H·hd, d_model] and a strength per head [H, d_model].
        self.direction_weight = nn.Parameter(
            torch.randn(layers, heads * head_dim, config.d_model) * 0.02
        )
        self.strength_weight = nn.Parameter(torch.randn(layers, heads, config.d_model) * 0.02)
        self.strength_bias = nn.Parameter(torch.full((layers, heads), params.beta_bias_init))

    @property
    def prefix_stable(self) -> bool:
        return False  # cached keys carry the transitions of every token after them

    def transitions(self, layer: int, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Unit directions [B, H, T, hd] and strengths β ∈ (0, 2) [B, H, T] of the tokens of
        ``hidden`` [B, T, d_model] (layer ``layer``'s normalised input)."""
        batch, length, _ = hidden.shape
        directions = F.linear(hidden, self.direction_weight[layer])
        directions = directions.view(batch, length, -1, self.config.head_dim).transpose(1, 2)
        strengths = 2 * torch.sigmoid(
            F.linear(hidden, self.strength_weight[layer], self.strength_bias[layer])
        )
        return F.normalize(directions.float(), dim=-1), strengths.float().transpose(1, 2)

    def move_keys(
        self,
        layer: int,
        hidden: Tensor,
        queries: Tensor,
        keys: Tensor,
        before: Tensor,
        new_tokens: Tensor | None,
    ) -> MovedKeys:
        directions, strengths = self.transitions(layer, hidden)
        if new_tokens is not None:  # padding turns nothing
            strengths = strengths * new_tokens.unsqueeze(1)
        return householder_pass(queries, keys, directions, strengths, before)


class PathForgettingPositions(PathPositions):
    """PaTH-FoX: PaTH's transitions and FoX's forget gates on the same scores."""

    name = "pathfox"
    kind = "data-dependent"
    claim = (
        "pathfox turns each key by the transitions of the tokens after it and fades it by "
        "their forget gates, both chosen by the tokens: the offset should change nothing."
    )
    keeps_key_state = True

    def __init__(self, config, params: PathParams) -> None:
        super().__init__(config, params)
        self.forgetting = ForgettingPositions(config, FoxParams())

    def key_state(self, layer: int, hidden: Tensor) -> Tensor:
        return self.forgetting.key_state(layer, hidden)

    def layer_bias(
        self,
        layer: int,
        queries: Tensor,
        keys: Tensor,
        key_state: Tensor | None,
        allowed: Tensor,
        explain: bool = True,
    ) -> LayerBias:
        return self.forgetting.layer_bias(layer, queries, keys, key_state, allowed, explain)
