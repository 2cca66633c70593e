"""FoX, the Forgetting Transformer (Lin et al., ICLR 2025): a data-dependent ALiBi.

Each layer and head computes a forget gate per token from the layer's input x_t,
f_t = σ(w·x_t + b) ∈ (0, 1), and the score of query i for key j gets D_ij = Σ_{l=j+1..i} log f_l:
a key loses log f_l for every token l that came after it, so a head that keeps f near 1 sees
far (NoPE), one that closes its gate forgets fast (ALiBi's decay, chosen by the content).
No positional vector is added anywhere, so any length is accepted.

Each token's log f is its ``key_state``: the KV cache keeps it beside the token's key, and every
forward sums the kept gates of the keys a query may see, so a cached step computes exactly what
the full forward does. D_ij is a sum over the tokens between key and query (a reversed cumulative
sum along the keys), not a difference of two running totals, which would lose digits to
cancellation once the totals grow long.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.kernels import fox as fox_kernel
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
class FoxParams:
    # The gates' bias at initialisation: 0 starts every gate near 1/2 (the paper's default
    # initialisation); a larger value starts nearer NoPE (σ(3) ≈ 0.95: a slow forgetting).
    bias_init: float = 0.0


def forgetting_bias(log_gates: Tensor, allowed: Tensor) -> Tensor:
    """D_ij = Σ_{l=j+1..i} log f_l for every key j that query i may see → [B, H, Tq, Tk].

    ``log_gates`` [B, H, Tk] per key, ``allowed`` [B|1, 1, Tq, Tk] bool. The sum runs over the
    keys the query may see after j (the query's own included), from the query back: row i of
    the reversed cumulative sum of the gates it may see, shifted by one key.
    """
    if fox_kernel.applies(log_gates):  # decoding on a CPU: the same sums in one loop
        return fox_kernel.forgetting_bias(log_gates, allowed)
    from_key = sum_back_to_each_key(log_gates.unsqueeze(-2), allowed)  # Σ over l ≥ j
    return F.pad(from_key[..., 1:], (0, 1))  # Σ over l > j (nothing after the last key)


class ForgettingPositions(PositionalScheme):
    name = "fox"
    kind = "data-dependent"
    claim = (
        "fox adds to each score the log forget gates of the tokens after the key, each gate "
        "computed from its token, never from a position: the offset should change nothing "
        "(up to rounding)."
    )
    Params = FoxParams
    data_dependent = True
    keeps_key_state = True
    kernel_bias = KernelBias.FORGETTING

    def __init__(self, config, params: FoxParams) -> None:
        super().__init__(config, params)
        layers, heads = config.n_layers, config.n_heads
        # Every layer has its own gate per head: [layers, heads, d_model] and [layers, heads].
        self.gate_weight = nn.Parameter(torch.randn(layers, heads, config.d_model) * 0.02)
        self.gate_bias = nn.Parameter(torch.full((layers, heads), float(params.bias_init)))

    def kernel_tensors(self, cache: KVCache) -> KernelTensors:
        return KernelTensors(self.gate_weight, self.gate_bias, cache.states, _EMPTY)

    def key_state(self, layer: int, hidden: Tensor) -> Tensor:
        """log f_t → [B, H, T] in float32 (it is summed over many tokens)."""
        weight, bias = self.gate_weight[layer], self.gate_bias[layer]  # [H, d_model], [H]
        if hidden.dtype != torch.float32:
            hidden, weight, bias = hidden.float(), weight.float(), bias.float()
        return F.logsigmoid(F.linear(hidden, weight, bias)).transpose(1, 2)

    def layer_bias(
        self,
        layer: int,
        queries: Tensor,
        keys: Tensor,
        key_state: Tensor | None,
        allowed: Tensor,
        explain: bool = True,
    ) -> LayerBias:
        assert key_state is not None  # the model hands every layer its keys' states
        gates = key_state.exp() if explain else None
        return LayerBias(forgetting_bias(key_state, allowed), gates=gates)
