"""The projections of a decode step — a few rows times a small weight — in one C++ loop.

A decode step multiplies 1 to 64 rows by each weight. MKL's GEMM is built for large products:
it packs panels of both operands before multiplying, and at these shapes that costs more than
the arithmetic. ``linear.cpp`` streams each weight once per four rows from a copy packed in
contiguous blocks of 64 outputs (:func:`packed`): whole greedy decodes run faster with it than
with MKL (``python -m bench.micro``; docs/performance.md).

It also makes the projections batch-invariant: every output is the same chain of multiply-adds
whatever the number of rows, so a row's projections are the same bits alone and in any batch
(MKL's are not: it blocks differently by shape), and so are its logits where the scheme's own
ops are row by row too (tests/model/kernels/test_linear.py), and on every ISA. Training
(gradients), other dtypes and devices, prompts of more than :data:`MAX_ROWS` tokens and a
process without kernels (``ORDINAL_CPU_ISA=torch``, no compiler) keep ``F.linear``.

On a CPU with AMX, a weight of bfloat16 values (the shipped checkpoints') multiplies on the tile
unit, each float32 input split exactly into three bfloat16 parts (linear_core.h's ``tiles``):
float32's products, in another order than the vector path's.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from model.cpu import cpu_flags
from model.kernels import active, decoding_on_cpu, ops

# Above this many rows MKL's packing pays for itself (at 64 rows the two are level).
MAX_ROWS = 64


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether ``x`` [..., in] · ``weight``ᵀ runs here: no gradient, float32 on a CPU, at most
    MAX_ROWS rows, outside torch.compile."""
    return (
        decoding_on_cpu(x)
        and x.numel() <= MAX_ROWS * x.shape[-1]
        and weight.dtype is torch.float32
        and ops() is not None
    )


COLUMNS = 64  # outputs per packed block: linear_core.h's kColumns
TILE_OUTPUTS, TILE_INPUTS = 16, 32  # a tile multiply's outputs and inputs: linear_core.h's tiles


def tiles_ready() -> bool:
    """Whether the active variant has its AMX path, this CPU the tiles, and this process may use
    them: a bfloat16 weight then multiplies on the tile unit (linear_core.h's ``tiles``). Set
    ``ORDINAL_TILES=0`` to keep every weight on the vector path."""
    isa = active()
    return isa is not None and _tiles(isa)


@functools.cache
def _tiles(isa: str) -> bool:
    kernels = ops(isa)
    return (
        os.environ.get("ORDINAL_TILES", "1") != "0"
        and {"amx_tile", "amx_bf16"} <= cpu_flags()
        and kernels is not None
        and bool(kernels.tiles())
    )


def version_of(weight: Tensor) -> tuple[int | None, int, tuple[int, ...]]:
    """What a copy kept from ``weight`` must match to still hold its values: the version
    counter (any in-place change, loading included), the address (new data under the
    parameter) and the strides."""
    # An inference tensor (a model loaded under torch.inference_mode) keeps no version counter;
    # it cannot be changed outside inference mode, and serving never changes its weights.
    version = None if weight.is_inference() else weight._version
    return version, weight.data_ptr(), weight.stride()


def packed(weight: Tensor) -> Tensor:
    """What the kernels read for ``weight`` [out, in]: a copy laid out for how they multiply.

    - When every value of ``weight`` is a bfloat16 value, ``in`` is a multiple of 32 and
      :func:`tiles_ready`: bfloat16 in the tile unit's pair layout, [ceil(out / 16), in / 32,
      16, 32] (:func:`tile_packed`).
    - Otherwise blocks of 64 outputs, [ceil(out / 64), in, 64] (the last block zero-padded), so
      that each block's weights are one contiguous run read front to back (linear_core.h says
      why) — bfloat16 when every value is one, else float32.

    The shipped checkpoints store bfloat16 weights, which a float32 model holds exactly; the
    kernels widen each bfloat16 back to that float32, so a product is the same as float32's from
    half the bytes — and a batch-1 step is mostly the reading of its weights. The copy is made
    again whenever :func:`version_of` the weight changes. It costs 2 bytes per weight in
    bfloat16, 4 in float32 (beside the model's own float32 weight)."""
    key = (version_of(weight), tiles_ready())
    kept: tuple[object, Tensor] | None = getattr(weight, "_ordinal_packed", None)
    if kept is None or kept[0] != key:
        narrow = weight.detach().to(torch.bfloat16)
        exact = torch.equal(narrow.float(), weight.detach())
        if exact and key[1] and weight.shape[1] % TILE_INPUTS == 0:
            copy = tile_packed(narrow)
        else:
            copy = blocked(narrow if exact else weight.detach())
        kept = (key, copy)
        weight._ordinal_packed = kept  # type: ignore[attr-defined]
    return kept[1]


def _padded(weight: Tensor, multiple: int) -> Tensor:
    """``weight`` [out, in] with zero rows added up to a multiple of ``multiple`` outputs."""
    out, inputs = weight.shape
    padded = weight.new_zeros(-(-out // multiple) * multiple, inputs)
    padded[:out] = weight
    return padded


def blocked(weight: Tensor) -> Tensor:
    """``weight`` [out, in] as blocks of 64 outputs, [ceil(out / 64), in, 64], zero-padded."""
    padded = _padded(weight, COLUMNS)
    return padded.view(-1, COLUMNS, weight.shape[1]).transpose(1, 2).contiguous()


def tile_packed(weight: Tensor) -> Tensor:
    """``weight`` [out, in] (bfloat16, ``in`` a multiple of 32) in the tile unit's pair layout,
    [ceil(out / 16), in / 32, 16, 32]: for 16 outputs and 32 inputs, row r holds each output's
    weights for inputs 2r and 2r + 1, side by side (outputs zero-padded)."""
    chunks = weight.shape[1] // TILE_INPUTS
    # [tile, output, chunk, pair, 2] → [tile, chunk, pair, output, 2]
    pairs = _padded(weight, TILE_OUTPUTS).view(-1, TILE_OUTPUTS, chunks, TILE_INPUTS // 2, 2)
    return pairs.permute(0, 2, 3, 1, 4).reshape(-1, chunks, 16, TILE_INPUTS)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [..., in] → [..., out] (check :func:`applies`)."""
    kernels = ops()
    assert kernels is not None, "check applies() first"
    rows = x.reshape(-1, x.shape[-1])
    contiguous = rows if rows.is_contiguous() else rows.contiguous()
    out = kernels.linear(contiguous, packed(weight), bias, weight.shape[0])
    return out.view(*x.shape[:-1], weight.shape[0])
