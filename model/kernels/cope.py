"""CoPE's bias as one custom op with its own gradient, for training and decoding on a CPU.

The reference (``model.positional.cope``) takes a dozen passes over [B, H, Tq, Tk] tensors per
layer — sigmoid, a reversed cumulative sum, floor and ceil, two gathers — and its backward two
scatters; torch.compile fuses neither the scan nor the gathers, so a compiled CoPE step took
about twice a T5 step. ``cope.cpp`` does the forward and the backward each in one pass per block
of queries (docs/performance.md, "CoPE's kernel"). ``torch.library`` registers both as ops with a
shape-only (fake) version, so torch.compile keeps them whole inside its graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.kernels import ops


@torch.compiler.assume_constant_result  # torch.compile reads the answer, never the build
def available() -> bool:
    """Whether the kernel is built (or can be): otherwise CoPE uses its torch reference."""
    return ops() is not None


def _flat(scores: Tensor, allowed: Tensor, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """[B, H, ...] → [B·H, ...] views (the mask: [B|1, Tq, Tk]), as the kernel takes them."""
    batch, heads, length, keys = scores.shape
    return (
        scores.reshape(batch * heads, length, keys),
        allowed.reshape(-1, length, keys),
        rows.reshape(batch * heads, length, rows.shape[-1]),
    )


def decode_bias(
    queries: Tensor, keys: Tensor, table: Tensor, allowed: Tensor, scale: float
) -> Tensor:
    """CoPE's bias [B, H, Tq, Tk] for a pass without gradients in float32 (decoding), from
    ``queries`` [B, H, Tq, hd], ``keys`` [B, H, Tk, hd] (views into the cache will do), the
    layer's ``table`` [n, hd] and ``allowed`` [B|1, 1, Tq, Tk] bool. The kernel computes the
    scores and rows itself, for the keys each block of queries sees: a decode step's one query
    per head costs no score tensor and no matrix products."""
    kernels = ops()
    assert kernels is not None, "check available() first"
    return kernels.cope_decode(queries, keys, table, allowed, scale)


@torch.library.custom_op("ordinal::cope_bias", mutates_args=())
def cope_bias(scores: Tensor, allowed: Tensor, rows: Tensor, scale: float) -> Tensor:
    """CoPE's bias [B, H, Tq, Tk] in the scores' dtype, from the unscaled scores q·k
    [B, H, Tq, Tk], ``allowed`` [B|1, 1, Tq, Tk] bool and each query's products with the table's
    rows q·e[k] [B, H, Tq, n] (the scores' dtype): σ(score · scale) gates summed from each key to
    the query, read between the rows (``model.positional.cope.interpolated_logits``)."""
    kernels = ops()
    assert kernels is not None, "check available() first"
    return kernels.cope_forward(*_flat(scores, allowed, rows), scale).view(scores.shape)


@cope_bias.register_fake
def _(scores: Tensor, allowed: Tensor, rows: Tensor, scale: float) -> Tensor:
    return torch.empty_like(scores)


@torch.library.custom_op("ordinal::cope_bias_backward", mutates_args=())
def cope_bias_backward(
    grad: Tensor, scores: Tensor, allowed: Tensor, rows: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """The gradients of :func:`cope_bias` for ``scores`` and ``rows``, given the bias's ``grad``."""
    kernels = ops()
    assert kernels is not None, "check available() first"
    flat_grad = grad.reshape(scores.shape[0] * scores.shape[1], *scores.shape[2:])
    d_scores, d_rows = kernels.cope_backward(flat_grad, *_flat(scores, allowed, rows), scale)
    return d_scores.view(scores.shape), d_rows.view(rows.shape)


@cope_bias_backward.register_fake
def _(
    grad: Tensor, scores: Tensor, allowed: Tensor, rows: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    return torch.empty_like(scores), torch.empty_like(rows)


def _save(ctx, inputs, output) -> None:  # torch.library's setup_context signature
    scores, allowed, rows, scale = inputs
    ctx.save_for_backward(scores, allowed, rows)
    ctx.scale = scale


def _backward(ctx, grad: Tensor):
    scores, allowed, rows = ctx.saved_tensors
    d_scores, d_rows = cope_bias_backward(grad, scores, allowed, rows, ctx.scale)
    return d_scores, None, d_rows, None


cope_bias.register_autograd(_backward, setup_context=_save)
