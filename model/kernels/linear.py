"""The projections of a decode step — a few rows times a small weight — in one C++ loop.

A decode step multiplies 1 to 64 rows by each weight. MKL's GEMM is built for large products:
it packs panels of both operands before multiplying, and at these shapes that costs more than
the arithmetic. ``linear.cpp`` streams each weight once per four rows, straight from the
column-major layout the model keeps: whole greedy decodes run 1.08-1.21x faster with it on this
project's CPU (``python -m bench.micro``; docs/performance.md).

It also makes the projections batch-invariant: every output is the same chain of multiply-adds
whatever the number of rows, so a row's projections are the same bits alone and in any batch
(MKL's are not: it blocks differently by shape), and so are its logits where the scheme's own
ops are row by row too (tests/model/kernels/test_linear.py). Training (gradients), other dtypes
and devices, prompts of more than :data:`MAX_ROWS` tokens and CPUs without AVX-512 keep
``F.linear``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.kernels import decoding_on_cpu, load, vectorised

# Above this many rows MKL's packing pays for itself (at 64 rows the two are level).
MAX_ROWS = 64


def ready() -> bool:
    """Whether the kernel is built (building it on first call) and this CPU has AVX-512."""
    return vectorised("linear")


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether ``x`` [..., in] · ``weight``ᵀ runs here: no gradient, float32 on a CPU, at most
    MAX_ROWS rows, the weight stored column-major, outside torch.compile."""
    return (
        decoding_on_cpu(x)
        and x.numel() <= MAX_ROWS * x.shape[-1]
        and weight.stride(0) == 1
        and weight.dtype is torch.float32
        and ready()
    )


def narrowed(weight: Tensor) -> Tensor:
    """What the kernels read for ``weight`` (float32, column-major): a bfloat16 copy in the same
    layout when every value of it is a bfloat16 value, else ``weight`` itself.

    The shipped checkpoints store bfloat16 weights, which a float32 model holds exactly; the
    kernels widen each bfloat16 back to that float32 in registers, so a product is the same bits
    from half the bytes — and a batch-1 step is mostly the reading of its weights. The copy is
    made once per version of the weight: loading or any in-place change (the version counter),
    or new data put under the parameter (its address), makes a new one."""
    key = (weight._version, weight.data_ptr(), weight.stride())
    kept: tuple[object, Tensor | None] | None = getattr(weight, "_ordinal_narrowed", None)
    if kept is None or kept[0] != key:
        narrow = weight.detach().to(torch.bfloat16)  # keeps the column-major layout
        kept = (key, narrow if torch.equal(narrow.float(), weight) else None)
        weight._ordinal_narrowed = kept  # type: ignore[attr-defined]
    return weight if kept[1] is None else kept[1]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [..., in] → [..., out] (check :func:`applies`)."""
    extension = load("linear")
    assert extension is not None, "check applies() first"
    rows = x.reshape(-1, x.shape[-1])
    contiguous = rows if rows.is_contiguous() else rows.contiguous()
    out = extension.linear(contiguous, narrowed(weight), bias)
    return out.view(*x.shape[:-1], weight.shape[0])
