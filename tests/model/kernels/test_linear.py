"""The decode-sized linear kernel (model/kernels/linear.cpp) computes F.linear, gives a row the
same bits alone and in any batch, and runs only where it applies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.kernels import linear as linear_kernel
from model.transformer import Linear, Transformer, _store_column_major
from tests.model.conftest import tiny_config

# Every variant this CPU runs (tests/conftest.py); a kernel that fails to build fails here.
pytestmark = pytest.mark.usefixtures("every_isa")


def column_major_linear(
    inputs: int, outputs: int, bias: bool, seed: int, narrow: bool = False
) -> Linear:
    """A decode-layout Linear with random weights; ``narrow``: weights that are bfloat16 values
    (as the shipped checkpoints'), which the kernel reads as bfloat16 — on the tile unit where
    the CPU has one and ``inputs`` is a multiple of 32."""
    torch.manual_seed(seed)
    linear = Linear(inputs, outputs, bias=bias)
    _store_column_major(linear)
    if narrow:
        with torch.no_grad():
            linear.weight.copy_(linear.weight.bfloat16().float())
    return linear


# Both ways the kernel multiplies: float32 weights, and bfloat16 values (the tile path).
WEIGHTS = pytest.mark.parametrize("narrow", [False, True], ids=["float32", "bfloat16"])


# Outputs: whole blocks of 64, a ragged last block, fewer than one vector, and the shipped
# vocabulary; inputs past one block of 128 and not a multiple of it.
@pytest.mark.parametrize(
    ("inputs", "outputs", "bias"),
    [(128, 384, False), (256, 768, True), (300, 77, True), (7, 5, True), (128, 2048, False)],
)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 6, 17, 64])
@WEIGHTS
def test_the_kernel_computes_f_linear(
    inputs: int, outputs: int, bias: bool, rows: int, narrow: bool
) -> None:
    linear = column_major_linear(inputs, outputs, bias, seed=rows, narrow=narrow)
    x = torch.randn(1, rows, inputs)
    with torch.no_grad():
        assert linear_kernel.applies(x, linear.weight)
        got = linear(x)
        bias64 = None if linear.bias is None else linear.bias.double()
        expected = F.linear(x.double(), linear.weight.double(), bias64)
    assert got.shape == (1, rows, outputs) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("inputs", "outputs"), [(256, 768), (300, 77), (64, 77)])
@WEIGHTS
def test_a_rows_output_is_the_same_bits_alone_and_in_any_batch(
    inputs: int, outputs: int, narrow: bool
) -> None:
    linear = column_major_linear(inputs, outputs, bias=True, seed=0, narrow=narrow)
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
    assert not linear_kernel.applies(few, linear.weight)  # gradients: autograd's F.linear


def test_a_weight_in_any_layout_gives_the_same_bits() -> None:
    """The kernel reads its own packed copy, so a row-major weight (an embedding tied to the
    logits, say) gives the bits the column-major one does."""
    linear = column_major_linear(200, 130, bias=True, seed=3)
    row_major = torch.nn.Linear(200, 130)
    x = torch.randn(6, 200)
    with torch.no_grad():
        row_major.weight.copy_(linear.weight)
        row_major.bias.copy_(linear.bias)
        assert row_major.weight.is_contiguous() and linear_kernel.applies(x, row_major.weight)
        from_row_major = linear_kernel.linear(x, row_major.weight, row_major.bias)
        assert torch.equal(from_row_major, linear(x))


def test_every_projection_of_the_model_is_a_column_major_kernel_linear() -> None:
    model = Transformer(tiny_config("rope"))
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    assert linears and all(isinstance(module, Linear) for module in linears)
    assert all(module.weight.stride(0) == 1 for module in linears)


def unpack(packed: torch.Tensor, outputs: int) -> torch.Tensor:
    """The weight [out, in] back from its packed copy [blocks, in, 64]."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:outputs]


@pytest.mark.parametrize("outputs", [384, 77, 5])
def test_the_packed_copy_holds_the_weight_in_blocks_of_64_outputs(outputs: int) -> None:
    linear = column_major_linear(130, outputs, bias=False, seed=outputs)
    with torch.no_grad():
        packed = linear_kernel.packed(linear.weight)
    blocks = -(-outputs // 64)
    assert packed.shape == (blocks, 130, 64) and packed.is_contiguous()
    assert packed.dtype is torch.float32  # random weights are not bfloat16 values
    assert torch.equal(unpack(packed, outputs), linear.weight)
    assert not unpack(packed, blocks * 64)[outputs:].any()  # the last block's padding: zeros


def test_weights_that_are_bfloat16_values_are_read_as_bfloat16_for_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the tile path, ``packed``: a bfloat16 copy in blocks of 64 exactly when every
    value of the weight is a bfloat16 value, made again after the weight changes; the kernel
    gives the same bits from it as from a float32 copy (and for a ragged last block)."""
    monkeypatch.setattr(linear_kernel, "tiles_ready", lambda: False)
    extension = linear_kernel.ops()
    for outputs in (384, 77):
        linear = column_major_linear(128, outputs, bias=True, seed=outputs)
        with torch.no_grad():
            linear.weight.copy_(linear.weight.bfloat16().float())  # bfloat16 values now
            narrow = linear_kernel.packed(linear.weight)
            assert narrow.dtype is torch.bfloat16
            assert torch.equal(unpack(narrow, outputs).float(), linear.weight)
            assert linear_kernel.packed(linear.weight) is narrow  # kept while unchanged
            x = torch.randn(5, 128)
            from_float = extension.linear(x, narrow.float(), linear.bias, outputs)
            assert torch.equal(extension.linear(x, narrow, linear.bias, outputs), from_float)
            assert torch.equal(linear(x), from_float)  # the layer reads the bfloat16 copy
            linear.weight[0, 0] += 1e-3  # no longer a bfloat16 value: a float32 copy again
            changed = linear_kernel.packed(linear.weight)
            assert changed.dtype is torch.float32
            assert torch.equal(unpack(changed, outputs), linear.weight)
            replaced = column_major_linear(128, outputs, bias=True, seed=1).weight.bfloat16()
            linear.weight.data = replaced.float()  # new data under the same parameter
            assert torch.equal(unpack(linear_kernel.packed(linear.weight), outputs), replaced)


def untile(packed: torch.Tensor, outputs: int) -> torch.Tensor:
    """The weight [out, in] back from its tile-packed copy [tiles, in / 32, 16, 32]."""
    tiles_, chunks = packed.shape[:2]
    pairs = packed.view(tiles_, chunks, 16, 16, 2).permute(0, 3, 1, 2, 4)
    return pairs.reshape(tiles_ * 16, chunks * 32)[:outputs]


@pytest.mark.parametrize("outputs", [384, 77, 5])
def test_bfloat16_weights_are_packed_for_the_tile_unit(
    monkeypatch: pytest.MonkeyPatch, outputs: int
) -> None:
    """With tiles, a weight of bfloat16 values with inputs a multiple of 32 is packed in the
    tile unit's pair layout (outputs zero-padded to 16); inputs that are not stay in blocks of
    64. (Packing is Python: checked on any CPU, as if it had the tiles.)"""
    monkeypatch.setattr(linear_kernel, "tiles_ready", lambda: True)
    linear = column_major_linear(96, outputs, bias=False, seed=outputs, narrow=True)
    with torch.no_grad():
        packed = linear_kernel.packed(linear.weight)
        assert packed.shape == (-(-outputs // 16), 3, 16, 32) and packed.is_contiguous()
        assert packed.dtype is torch.bfloat16
        assert torch.equal(untile(packed, outputs).float(), linear.weight)
        assert not untile(packed, -(-outputs // 16) * 16)[outputs:].any()
        ragged = column_major_linear(100, outputs, bias=False, seed=outputs, narrow=True)
        assert linear_kernel.packed(ragged.weight).dim() == 3


def test_a_model_loaded_under_inference_mode_projects_in_the_kernel() -> None:
    """Weights made under torch.inference_mode (a benchmark or a script loading a checkpoint
    there) keep no version counter: the packed copy is kept by the weight's address instead, and
    the kernel's product is F.linear's."""
    with torch.inference_mode():
        linear = column_major_linear(128, 256, bias=True, seed=3)
        assert linear.weight.is_inference()
        x = torch.randn(2, 128)
        assert linear_kernel.applies(x, linear.weight)
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias))
        assert linear_kernel.packed(linear.weight) is linear_kernel.packed(linear.weight)
