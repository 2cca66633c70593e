"""Each row's argmax, for the greedy draw of a decode step.

``torch.argmax`` over a [rows, vocabulary] matrix walks it one float at a time: 115 µs at
[64, 2048] on one thread of this project's CPU, a few percent of a greedy 64-row decode step.
``argmax.cpp`` finds each row's largest value 16 floats at a time, then its first index: the
same answer (ties to the lowest index, a NaN counted as the largest) in 11 µs (one-off timing;
docs/performance.md, sixth round).
Gradients, other dtypes and devices, and CPUs without AVX-512 keep ``torch.argmax``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.kernels import decoding_on_cpu, load, vectorised


def ready() -> bool:
    """Whether the kernel is built (building it on first call) and this CPU has AVX-512."""
    return vectorised("argmax")


def applies(x: Tensor) -> bool:
    """Whether ``x`` [rows, n] (n ≥ 1) takes the kernel: float32 on a CPU, no gradient, AVX-512."""
    return (
        x.dim() == 2
        and x.shape[1] > 0
        and x.dtype is torch.float32
        and decoding_on_cpu(x)
        and ready()
    )


def argmax(x: Tensor) -> Tensor:
    """``x.argmax(dim=-1)`` for ``x`` [rows, n] → [rows] int64 (check :func:`applies`)."""
    extension = load("argmax")
    assert extension is not None, "check applies() first"
    return extension.argmax(x if x.is_contiguous() else x.contiguous())
