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
    """
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = rotated.chunk(2, dim=-1)
    rotated_half = torch.cat((-second, first), dim=-1)
    out = rotated * cos.to(x.dtype) + rotated_half * sin.to(x.dtype)
    return torch.cat((out, passed), dim=-1) if passed.shape[-1] else out
