"""Each row's token for a temperature-only sampled draw, the commonest sampled request.

In torch the draw is six ops over [rows, vocabulary] — divide, softmax, cumulative sum, scale,
clamp, search — each a pass and a dispatch, more costly still inside a decode step, whose
weights have just pushed them out of the caches. ``draw.cpp`` does it in two passes per row, 16
tokens at a time, with simd.h's exp (docs/performance.md has the timings): the same inverse-CDF
draw (the first token whose cumulative mass reaches the row's uniform × the total, never one
without mass, one past the vocabulary for a uniform outside [0, 1)), with float32 sums in
another order and exps within 2e-7 — so a uniform within a rounding of a boundary may land on
the other side of it. Gradients, other dtypes and devices, and a process without kernels keep
the torch ops.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from model.kernels import decoding_on_cpu, ops


def applies(logits: Tensor) -> bool:
    """Whether ``logits`` [rows, V] (V ≥ 1) take the kernel: float32 on a CPU, no gradient,
    kernels built."""
    return (
        logits.dim() == 2 and logits.shape[1] > 0 and decoding_on_cpu(logits) and ops() is not None
    )


def tempered(logits: Tensor, temperature: Tensor, uniforms: Tensor) -> Tensor:
    """Each row's draw from softmax(``logits`` / ``temperature``) by its uniform: logits
    [rows, V] float32, temperature and uniforms [rows] float32 → [rows] int64, V for a uniform
    outside [0, 1) (check :func:`applies`)."""
    return _extension().tempered(*_arguments(logits, temperature, uniforms))


def tempered_raw(logits: Tensor, temperature: Tensor, uniforms: Tensor) -> tuple[Tensor, int]:
    """:func:`tempered` of the model's own logits, checked on the way: → (tokens [rows] int64,
    how many rows failed). A row with a NaN or infinite logit gets −1, one whose uniform is
    outside [0, 1) V; a step whose rows are all fine needs no other check (the batch's finite
    sum and the range test after the draw)."""
    tokens, failed = _extension().tempered_raw(*_arguments(logits, temperature, uniforms))
    return tokens, int(failed)


def _extension() -> Any:
    kernels = ops()
    assert kernels is not None, "check applies() first"
    return kernels


def _arguments(logits: Tensor, temperature: Tensor, uniforms: Tensor) -> tuple[Tensor, ...]:
    """The kernel's inputs: contiguous logits, float32 temperatures and uniforms."""
    return (
        logits if logits.is_contiguous() else logits.contiguous(),
        temperature.float(),
        uniforms.float(),
    )
