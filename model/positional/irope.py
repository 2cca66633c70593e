"""RoPE/NoPE interleaving: rope in some layers, no positional signal in the others (Llama 4's
iRoPE, Cohere's RNoPE-SWA, SmolLM3; Hugging Face configs call the NoPE layers
``no_rope_layers``).

``layers`` is the schedule, a comma-separated pattern of ``rope`` and ``none`` repeated over the
model's layers: the default ``rope,rope,rope,none`` makes every fourth layer NoPE, as Llama 4
does. The rope layers rotate queries and keys exactly as ``rope`` does (every rope option
applies), optionally seeing only the last ``window`` keys (RNoPE-SWA's sliding window); the
NoPE layers see every key, with queries scaled by Llama 4's attention temperature
log(⌊(p + 1) / temperature_floor⌋ + 1) · temperature_scale + 1 when ``temperature_floor`` is
set, which sharpens attention past the floor so that a long context does not flatten it.

With every layer ``rope`` (and no window) this is rope, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from model.positional.rope import RopeParams, RotaryPositions

LAYER_KINDS = ("rope", "none")


@dataclass(frozen=True)
class InterleavedParams(RopeParams):
    layers: str = "rope,rope,rope,none"  # repeated over the model's layers
    window: int | None = None  # rope layers: a query sees its own key and the window − 1 before
    temperature_floor: int | None = None  # NoPE layers: Llama 4's query scale (None: off)
    temperature_scale: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        kinds = self.pattern
        if not kinds or any(kind not in LAYER_KINDS for kind in kinds):
            raise ValueError(
                f"positional.layers must list {' or '.join(LAYER_KINDS)} separated by commas, "
                f"got {self.layers!r}"
            )
        if self.window is not None and self.window < 1:
            raise ValueError(f"positional.window must be ≥ 1, got {self.window}")
        if self.temperature_floor is not None and self.temperature_floor < 1:
            raise ValueError(
                f"positional.temperature_floor must be ≥ 1, got {self.temperature_floor}"
            )

    @property
    def pattern(self) -> list[str]:
        return [kind.strip() for kind in self.layers.split(",")]


class InterleavedPositions(RotaryPositions):
    name = "irope"
    kind = "rotation"
    claim = (
        "irope is rope in some layers and none in the others: the offset changes nothing "
        "(a NoPE layer's temperature aside), and dropping the rotation leaves the NoPE layers "
        "as they were."
    )
    Params = InterleavedParams
    # The decode kernel runs one rotation for every layer: this schedule takes the torch blocks.
    kernel_bias = None

    def __init__(self, config, params: InterleavedParams) -> None:
        super().__init__(config, params)
        pattern = params.pattern
        self.rope_layers = frozenset(
            layer for layer in range(config.n_layers) if pattern[layer % len(pattern)] == "rope"
        )

    def acts_at(self, layer: int) -> bool:
        return layer in self.rope_layers

    def attention_bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor | None:
        window = self.params.window
        if window is None:
            return None
        distance = q_positions.unsqueeze(-1) - k_positions  # [B, Tq, Tk]
        outside = distance >= window  # later keys are masked by causality already
        bias = torch.zeros(outside.shape, device=outside.device).masked_fill(outside, -math.inf)
        return bias.unsqueeze(1)  # [B, 1, Tq, Tk]: the same for every head

    def query_scale(self, positions: Tensor) -> Tensor | None:
        floor = self.params.temperature_floor
        if floor is None:
            return None
        steps = torch.floor((positions.to(torch.float32) + 1) / floor)
        scale = torch.log(steps + 1) * self.params.temperature_scale + 1  # [B, T]
        return scale[:, None, :, None]  # [B, 1, T, 1]
