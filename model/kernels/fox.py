"""FoX's decay bias in one C++ loop, for decoding on a CPU.

``model.positional.fox.forgetting_bias`` is a reversed cumulative sum of the gates a query sees,
shifted by one key: seven torch ops per layer, each a dispatch and a fresh tensor for a decode
step's single row of keys, which made fox the slowest scheme to decode (docs/performance.md).
``fox.cpp`` computes the same sums in the same order, in double as torch's CPU cumsum does, so
the bits are the reference's. Passes that record gradients keep the reference (autograd
differentiates it).
"""

from __future__ import annotations

from torch import Tensor

from model.kernels import decoding_on_cpu, ops


def applies(log_gates: Tensor) -> bool:
    """Whether this pass's bias can come from the kernel: no gradient, float32 on a CPU, kernels
    built."""
    return decoding_on_cpu(log_gates) and ops() is not None


def forgetting_bias(log_gates: Tensor, allowed: Tensor) -> Tensor:
    """The reference's ``forgetting_bias``: ``log_gates`` [B, H, Tk], ``allowed``
    [B|1, 1, Tq, Tk] bool → [B, H, Tq, Tk] (check :func:`applies` first)."""
    kernels = ops()
    assert kernels is not None, "check applies() first"
    batch, heads, keys = log_gates.shape
    length = allowed.shape[-2]
    flat = kernels.forgetting_bias(
        log_gates.reshape(batch * heads, keys), allowed.reshape(-1, length, keys)
    )
    return flat.view(batch, heads, length, keys)
