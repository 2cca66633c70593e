"""CoPE, contextual position encoding (Golovneva et al., 2024): positions that count only the
tokens the model gates in.

For query i and key j, a gate g_ij = σ(q_i·k_j/√hd) says whether key j counts; the position
of j seen from i is p_ij = Σ_{t=j..i} g_it, the number of counted tokens from j to i (so a head
can count words, sentences or speeches instead of tokens). p_ij is a real number: its embedding
interpolates the learned rows e[⌊p⌋] and e[⌈p⌉], and the score gets q_i·e[p_ij] (unscaled, as
the paper's code). Each layer has its own table of ``n_positions`` rows of head_dim, shared by
its heads, starting at zero (the paper's initialisation: CoPE starts as NoPE); positions past
the last row are clamped to it, so any length is accepted.

Everything comes from the layer's queries and the keys they may see, which the KV cache holds
already: a cached step computes exactly what the full forward does.

The functions here are the definition, which the trace runs (it shows the positions). Training
and decoding on a CPU run the same computation as one C++ op (``model.kernels.cope``, tested
equal to these), which takes a compiled step from about twice a T5 step to near one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from model.kernels import cope as cope_kernel
from model.kernels import decoding_on_cpu
from model.positional.base import (
    _EMPTY,
    KernelBias,
    KernelTensors,
    LayerBias,
    PositionalScheme,
    sum_back_to_each_key,
)

if TYPE_CHECKING:
    from model.cache import KVCache


@dataclass(frozen=True)
class CopeParams:
    n_positions: int | None = None  # rows of each layer's table (None: the context length)

    def __post_init__(self) -> None:
        if self.n_positions is not None and self.n_positions < 2:
            raise ValueError(f"positional.n_positions must be ≥ 2, got {self.n_positions}")


def contextual_positions(queries: Tensor, keys: Tensor, allowed: Tensor) -> Tensor:
    """p_ij = Σ_{t=j..i} σ(q_i·k_t/√hd) over the keys query i may see → [B, H, Tq, Tk].

    ``queries`` [B, H, Tq, hd], ``keys`` [B, H, Tk, hd], ``allowed`` [B|1, 1, Tq, Tk] bool; a key
    the query may not see has gate 0 (and so counts nothing).
    """
    # float32 whatever the run dtype: a bfloat16 running sum could not count past 256 by ones
    scores = queries.float() @ keys.float().transpose(-2, -1) / math.sqrt(queries.shape[-1])
    return sum_back_to_each_key(scores.sigmoid(), allowed)


def interpolated_logits(queries: Tensor, table: Tensor, positions: Tensor) -> Tensor:
    """q_i·e[p_ij], e at a real p read between rows ⌊p⌋ and ⌈p⌉ → [B, H, Tq, Tk].

    ``table`` [n, hd]; ``positions`` [B, H, Tq, Tk] (clamped to 0..n−1 here). Interpolating the
    n dot products q·e[k] equals the dot product with the interpolated embedding, and costs n
    products per query instead of one per key.
    """
    positions = positions.clamp(max=table.shape[0] - 1)
    at_rows = queries.float() @ table.T.float()  # [B, H, Tq, n]: q_i·e[k] for every row k
    below, above = positions.floor().long(), positions.ceil().long()
    weight = positions - below
    return at_rows.gather(-1, above) * weight + at_rows.gather(-1, below) * (1 - weight)


class ContextualPositions(PositionalScheme):
    name = "cope"
    kind = "data-dependent"
    claim = (
        "cope counts a key's position as the keys its query gates in, σ(q·k), from the "
        "tokens alone: the offset should change nothing (up to rounding)."
    )
    Params = CopeParams
    data_dependent = True
    kernel_bias = KernelBias.CONTEXTUAL

    def __init__(self, config, params: CopeParams) -> None:
        super().__init__(config, params)
        rows = params.n_positions or config.context_length
        self.table = nn.Parameter(torch.zeros(config.n_layers, rows, config.head_dim))

    def kernel_tensors(self, cache: KVCache) -> KernelTensors:
        return KernelTensors(_EMPTY, _EMPTY, _EMPTY, self.table)

    def layer_bias(
        self,
        layer: int,
        queries: Tensor,
        keys: Tensor,
        key_state: Tensor | None,
        allowed: Tensor,
        explain: bool = True,
    ) -> LayerBias:
        table = self.table[layer]
        scale = 1 / math.sqrt(queries.shape[-1])
        if queries.is_cpu and _records_gradients(queries, table) and cope_kernel.available():
            # training: the op with its backward, which torch.compile keeps in its graph
            scores = queries @ keys.transpose(-2, -1)  # in the run's dtype, as attention's
            rows = queries @ table.T.to(queries.dtype)
            return LayerBias(cope_kernel.cope_bias(scores, allowed, rows, scale))
        if not explain and decoding_on_cpu(queries) and cope_kernel.available():
            return LayerBias(cope_kernel.decode_bias(queries, keys, table, allowed, scale))
        positions = contextual_positions(queries, keys, allowed)
        bias = interpolated_logits(queries, table, positions)
        return LayerBias(bias, positions=positions)


def _records_gradients(queries: Tensor, table: Tensor) -> bool:
    """Whether this pass records gradients (training), for which the kernel's op has a backward."""
    return torch.is_grad_enabled() and (queries.requires_grad or table.requires_grad)
