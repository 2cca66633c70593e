"""The decode-sized linear kernel (model/kernels/linear.cpp) computes F.linear, gives a row the
same bits alone and in any batch, and runs only where it applies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.kernels import linear as linear_kernel
from model.transformer import Linear, Transformer, _store_column_major
from tests.model.conftest import tiny_config

pytestmark = pytest.mark.skipif(
    not linear_kernel.ready(), reason="the linear kernel needs a C++ compiler and AVX-512"
)


def column_major_linear(inputs: int, outputs: int, bias: bool, seed: int) -> Linear:
    torch.manual_seed(seed)
    linear = Linear(inputs, outputs, bias=bias)
    _store_column_major(linear)
    return linear


# Outputs: whole blocks of 64, a ragged last block, fewer than one vector, and the shipped
# vocabulary; inputs past one block of 128 and not a multiple of it.
@pytest.mark.parametrize(
    ("inputs", "outputs", "bias"),
    [(128, 384, False), (256, 768, True), (300, 77, True), (7, 5, True), (128, 2048, False)],
)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 64])
def test_the_kernel_computes_f_linear(inputs: int, outputs: int, bias: bool, rows: int) -> None:
    linear = column_major_linear(inputs, outputs, bias, seed=rows)
    x = torch.randn(1, rows, inputs)
    with torch.no_grad():
        assert linear_kernel.applies(x, linear.weight)
        got = linear(x)
        bias64 = None if linear.bias is None else linear.bias.double()
        expected = F.linear(x.double(), linear.weight.double(), bias64)
    assert got.shape == (1, rows, outputs) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("inputs", "outputs"), [(256, 768), (300, 77)])
def test_a_rows_output_is_the_same_bits_alone_and_in_any_batch(inputs: int, outputs: int) -> None:
    linear = column_major_linear(inputs, outputs, bias=True, seed=0)
    batch = torch.randn(37, inputs)
    with torch.no_grad():
        together = linear(batch)
        for row in range(37):
            assert torch.equal(linear(batch[row : row + 1])[0], together[row]), row
        assert torch.equal(linear(batch[5:9]), together[5:9])


def test_it_applies_only_to_decoding_in_float32_on_a_cpu() -> None:
    linear = column_major_linear(16, 32, bias=True, seed=0)
    few, many = torch.randn(2, 8, 16), torch.randn(2, linear_kernel.MAX_ROWS, 16)
    with torch.no_grad():
        assert linear_kernel.applies(few, linear.weight)
        assert not linear_kernel.applies(many, linear.weight)  # a long prompt: MKL's GEMM
        assert not linear_kernel.applies(few.bfloat16(), linear.weight)
        row_major = torch.nn.Linear(16, 32)  # not stored column-major
        assert not linear_kernel.applies(few, row_major.weight)
    assert not linear_kernel.applies(few, linear.weight)  # gradients: autograd's F.linear


def test_every_projection_of_the_model_is_a_column_major_kernel_linear() -> None:
    model = Transformer(tiny_config("rope"))
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    assert linears and all(isinstance(module, Linear) for module in linears)
    assert all(module.weight.stride(0) == 1 for module in linears)


def test_weights_that_are_bfloat16_values_are_read_as_bfloat16_for_the_same_bits() -> None:
    """``narrowed``: a bfloat16 copy (column-major too) exactly when every value of the weight
    is a bfloat16 value, made again after the weight changes; the kernel gives the same bits
    from it as from the float32 weight (and for a ragged last block)."""
    for outputs in (384, 77):
        linear = column_major_linear(128, outputs, bias=True, seed=outputs)
        with torch.no_grad():
            assert linear_kernel.narrowed(linear.weight) is linear.weight  # not bf16 values
            linear.weight.copy_(linear.weight.bfloat16().float())  # now they are
            narrow = linear_kernel.narrowed(linear.weight)
            assert narrow.dtype is torch.bfloat16 and narrow.t().is_contiguous()
            assert torch.equal(narrow.float(), linear.weight)
            assert linear_kernel.narrowed(linear.weight) is narrow  # kept while unchanged
            x = torch.randn(5, 128)
            extension = linear_kernel.load("linear")
            from_float = extension.linear(x, linear.weight, linear.bias)
            assert torch.equal(linear(x), from_float)  # the kernel read the bfloat16 copy
            assert torch.equal(extension.linear(x, narrow, linear.bias), from_float)
            linear.weight[0, 0] += 1e-3  # no longer a bfloat16 value: the float32 weight again
            assert linear_kernel.narrowed(linear.weight) is linear.weight
            replaced = column_major_linear(128, outputs, bias=True, seed=1).weight.bfloat16()
            linear.weight.data = replaced.float()  # new data under the same parameter
            assert torch.equal(linear_kernel.narrowed(linear.weight), replaced)
