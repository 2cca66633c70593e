"""The rotation of queries and keys, shared by the scheme that makes it and the attention that
applies it.

A scheme's ``rotation(positions)`` returns cos/sin tables; ``apply_rotation`` turns each pair of
dimensions (NeoX half-split layout: dimension i pairs with i + rot/2) by its angle. Rope builds
the tables (``model.positional.rope``), ``PositionalScheme.rotate`` and the transformer's
attention apply them; neither needs the other.
"""

import torch
from torch import Tensor

Rotation = tuple[Tensor, Tensor]  # (cos, sin), each [..., T, rotary_dim]


def apply_rotation(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x`` [..., T, head_dim]; the rest pass through.

    ``cos``/``sin`` [..., T, rot] broadcast against ``x``'s leading dims.

    Pair (a, b) becomes (a·cos − b·sin, b·cos + a·sin): one product with cos, then each half
    takes its sine term in place (two ``addcmul_``), three kernels where the textbook form
    (negate, concatenate, two products, a sum) takes five: a decode step runs it once per layer.
    """
    if cos.dtype != x.dtype:  # a no-op `.to` still costs a dispatch per layer and step
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rotary_dim = cos.shape[-1]
    whole = rotary_dim == x.shape[-1]
    rotated = x if whole else x[..., :rotary_dim]
    first, second = rotated.chunk(2, dim=-1)
    sin_first, sin_second = sin.chunk(2, dim=-1)
    half = rotary_dim // 2
    out = rotated * cos
    # narrow, not chunk: autograd lets a single view be written in place (training runs this)
    out.narrow(-1, 0, half).addcmul_(second, sin_first, value=-1.0)
    out.narrow(-1, half, half).addcmul_(first, sin_second)
    return out if whole else torch.cat((out, x[..., rotary_dim:]), dim=-1)
