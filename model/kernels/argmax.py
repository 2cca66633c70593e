"""Each row's argmax, for the greedy draw of a decode step.

``torch.argmax`` over a [rows, vocabulary] matrix walks it one float at a time, a few percent
of a greedy 64-row decode step. ``argmax.cpp`` finds each row's largest value 16 floats at a
time, then its first index: the same answer (ties to the lowest index, a NaN counted as the
largest) in a tenth of the time (docs/performance.md). Gradients, other dtypes and devices,
and a process without kernels keep ``torch.argmax``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.kernels import decoding_on_cpu, ops


def applies(x: Tensor) -> bool:
    """Whether ``x`` [rows, n] (n ≥ 1) takes the kernel: float32 on a CPU, no gradient, kernels
    built."""
    return (
        x.dim() == 2
        and x.shape[1] > 0
        and x.dtype is torch.float32
        and decoding_on_cpu(x)
        and ops() is not None
    )


def argmax(x: Tensor) -> Tensor:
    """``x.argmax(dim=-1)`` for ``x`` [rows, n] → [rows] int64 (check :func:`applies`)."""
    kernels = ops()
    assert kernels is not None, "check applies() first"
    return kernels.argmax(x if x.is_contiguous() else x.contiguous())
