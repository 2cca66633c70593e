"""Which code runs a model's decode steps: chosen once per model, device and kernel variant.

- ``cpu-kernel``: the whole step in one C++ call (``model.kernels.decode_step``), on a CPU
  whose kernel variant is built (``model.kernels``), for a model the kernel can run: float32,
  a norm and an MLP it knows, no QK-norm, and a scheme that declares what the kernel computes
  for it (``PositionalScheme.kernel_bias``);
- ``cuda-graphs``: steps replayed from CUDA graphs (``model.captured``) on a GPU;
- ``torch``: the torch blocks, the definition, for everything else.

The choice is made the first time a model decodes on a device with a variant, logged once
with its reason (``ordinal.backend``), and kept on the model (:func:`backend_of`, read as
``Transformer.decode_backend``): no decode step asks again, and a model the kernel cannot run
is never silently run by it. What a single pass may still send to the torch blocks is the
pass's own shape (``decode_step.applies``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import torch

from model import cpu, kernels
from model.kernels import decode_step

if TYPE_CHECKING:
    from model.transformer import Transformer

logger = logging.getLogger("ordinal.backend")

GRAPHS_SWITCH = "ORDINAL_CUDA_GRAPHS"  # "0": every decode step on a GPU eager


class Backend(StrEnum):
    TORCH = "torch"
    CPU_KERNEL = "cpu-kernel"
    CUDA_GRAPHS = "cuda-graphs"


@dataclass(frozen=True)
class Choice:
    """A model's decode backend on one device, and why (one line, for the log)."""

    backend: Backend
    why: str


def graphs_wanted(device: torch.device) -> bool:
    """Whether decode steps on ``device`` are captured by default: on a CUDA GPU, unless
    ``ORDINAL_CUDA_GRAPHS=0``."""
    return device.type == "cuda" and os.environ.get(GRAPHS_SWITCH, "1") != "0"


def choose(model: Transformer) -> Choice:
    """The backend for ``model`` as it is now (device, dtype) with the active kernel variant."""
    weight = model.lm_head.weight
    if weight.is_cuda:
        if graphs_wanted(weight.device):
            return Choice(Backend.CUDA_GRAPHS, "a CUDA GPU: steps replayed from graphs")
        return Choice(Backend.TORCH, f"a CUDA GPU with {GRAPHS_SWITCH}=0")
    if not weight.is_cpu:
        return Choice(Backend.TORCH, f"no kernel for {weight.device.type}")
    refusal = kernel_refusal(model)
    if refusal is not None:
        return Choice(Backend.TORCH, refusal)
    return Choice(Backend.CPU_KERNEL, f"the {kernels.active()} kernels")


def kernel_refusal(model: Transformer) -> str | None:
    """Why the CPU decode kernel cannot run ``model``, or None when it can."""
    config, scheme = model.config, model.positional
    if scheme.kernel_bias is None:
        return f"the {scheme.name!r} scheme declares no kernel bias (PositionalScheme.kernel_bias)"
    if model.lm_head.weight.dtype is not torch.float32:
        return f"{model.lm_head.weight.dtype} weights (the kernel is float32)"
    if config.qk_norm:
        return "QK-norm (not in the kernel)"
    if config.norm not in decode_step.NORMS:
        return f"norm {config.norm!r} (not in the kernel)"
    if config.mlp not in decode_step.MLPS:
        return f"mlp {config.mlp!r} (not in the kernel)"
    try:
        isa = kernels.active()
    except cpu.IsaError as error:
        return str(error)
    if isa is None:
        return f"{cpu.ENVIRONMENT}=torch, or no vector variant for this CPU"
    if kernels.ops(isa) is None:
        return f"the {isa} kernels could not be built"
    return None


def backend_of(model: Transformer) -> Backend:
    """``model``'s decode backend, chosen (and logged) once per device, dtype and variant."""
    key = (model.lm_head.weight.device, model.lm_head.weight.dtype, _variant())
    kept: tuple[object, Choice] | None = model.__dict__.get("_ordinal_backend")
    if kept is None or kept[0] != key:
        choice = choose(model)
        name = model.positional.name
        logger.info("decode backend for %s: %s (%s)", name, choice.backend, choice.why)
        kept = (key, choice)
        model.__dict__["_ordinal_backend"] = kept
    return kept[1].backend


def _variant() -> str | None:
    try:
        return kernels.active()
    except cpu.IsaError:
        return None
