"""Each row's argmax, for the greedy draw of a decode step.

``torch.argmax`` over a [rows, vocabulary] matrix walks it one float at a time: 115 µs at
[64, 2048] on one thread of this project's CPU, about as long as a row's whole block of the
shipped model takes in the decode-step kernel. ``argmax.cpp`` finds each row's largest value 16
floats at a time, then its first index: the same answer (ties to the lowest index, a NaN counted
as the largest), in a tenth of the time (``python -m bench.micro``; docs/performance.md).
Gradients, other dtypes and devices, and CPUs without AVX-512 keep ``torch.argmax``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.kernels import decoding_on_cpu, load, vectorised


def applies(x: Tensor) -> bool:
    """Whether ``x`` [rows, n] (n ≥ 1) takes the kernel: float32 on a CPU, no gradient, AVX-512."""
    return (
        x.dim() == 2
        and x.shape[1] > 0
        and x.dtype is torch.float32
        and decoding_on_cpu(x)
        and vectorised("argmax")
    )


def argmax(x: Tensor) -> Tensor:
    """``x.argmax(dim=-1)`` for ``x`` [rows, n] → [rows] int64 (check :func:`applies`)."""
    extension = load("argmax")
    assert extension is not None, "check applies() first"
    return extension.argmax(x if x.is_contiguous() else x.contiguous())
