"""The linear kernel's AMX tile path (linear_core.h's ``tiles``, in the AVX-512 variant):
float32's accuracy from bfloat16 tiles, and the switch that keeps weights off them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import model.cpu as cpu
import model.kernels as kernels
from model.kernels import linear as linear_kernel
from tests.model.kernels.test_linear import column_major_linear

# The tile unit's own tests need its hardware: AMX (Sapphire Rapids and later).
pytestmark = pytest.mark.skipif(
    not ({"amx_tile", "amx_bf16"} <= cpu.cpu_flags() and "avx512" in cpu.runnable()),
    reason="the tile path needs a CPU with AMX",
)


@pytest.fixture(autouse=True)
def avx512() -> Iterator[None]:
    """The AVX-512 variant, the one with the tile path, whose tiles this process may use."""
    with kernels.using("avx512"):
        assert linear_kernel.tiles_ready(), "AMX is there, but Linux did not grant the tiles"
        yield


def test_the_tile_path_keeps_every_bit_of_the_float32_input() -> None:
    """Each float32 input is multiplied as the exact sum of three bfloat16 parts: the result is
    as close to float64's as a float32 product is. With the last part dropped, errors would be
    ~2^-17 of each input (here ~1e-4), not ~1e-6."""
    linear = column_major_linear(512, 256, bias=False, seed=4, narrow=True)
    x = torch.randn(7, 512) * 3
    with torch.no_grad():
        got = linear(x).double()
        expected = x.double() @ linear.weight.double().T
        float32 = (x @ linear.weight.T).double()
    assert (got - expected).abs().max() <= 2 * (float32 - expected).abs().max() + 1e-6


def test_tiles_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ORDINAL_TILES=0`` keeps every weight in blocks of 64 for the vector path."""
    linear = column_major_linear(128, 64, bias=False, seed=2, narrow=True)
    with torch.no_grad():
        assert linear_kernel.packed(linear.weight).dim() == 4
        monkeypatch.setenv("ORDINAL_TILES", "0")
        linear_kernel._tiles.cache_clear()
        try:
            assert linear_kernel.packed(linear.weight).dim() == 3  # made again for the switch
        finally:
            monkeypatch.delenv("ORDINAL_TILES")
            linear_kernel._tiles.cache_clear()
