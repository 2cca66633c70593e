"""FoX's decode kernel (model/kernels/fox.cpp) gives the reference's bias bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.kernels import fox as fox_kernel
from model.positional.fox import forgetting_bias

# Every variant this CPU runs (tests/conftest.py); a kernel that fails to build fails here.
pytestmark = pytest.mark.usefixtures("every_isa")


@pytest.mark.parametrize(
    ("batch", "queries", "keys", "mask_rows"),
    [(3, 1, 41, 3), (2, 9, 9, 1), (1, 6, 30, 1)],  # a ragged decode step, a prompt, a chunk
)
def test_the_kernel_gives_the_references_bias_bit_for_bit(
    batch: int, queries: int, keys: int, mask_rows: int
) -> None:
    generator = torch.Generator().manual_seed(keys)
    log_gates = F.logsigmoid(torch.randn(batch, 4, keys, generator=generator) * 3)
    causal = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries)
    allowed = causal & (torch.rand(mask_rows, 1, queries, keys, generator=generator) > 0.2)
    with torch.no_grad():
        assert fox_kernel.applies(log_gates)
        got = forgetting_bias(log_gates, allowed)
    expected = forgetting_bias(log_gates.requires_grad_(), allowed)  # gradients: the reference
    assert not fox_kernel.applies(log_gates)
    assert torch.equal(got, expected.detach())
