"""The argmax kernel (model/kernels/argmax.cpp) gives torch.argmax's answer — ties to the lowest
index, a NaN counted as the largest — and the greedy draw takes it where it applies."""

from __future__ import annotations

import pytest
import torch

from model.kernels import argmax as argmax_kernel
from model.sampling import RowSampler, SamplingBatch
from model.sampling_params import SamplingParams

# Every variant this CPU runs (tests/conftest.py); a kernel that fails to build fails here.
requires_kernel = pytest.mark.usefixtures("every_isa")


def matrix(rows: int, columns: int, kind: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if kind == "ties":  # a handful of values: every row's largest several times
        return torch.randint(-3, 3, (rows, columns), generator=generator).float()
    x = torch.randn(rows, columns, generator=generator)
    scattered = torch.rand(rows, columns, generator=generator)
    if kind == "nan":
        x[scattered < 0.02] = float("nan")
    elif kind == "infinities":
        x[scattered < 0.3] = float("-inf")
        x[scattered > 0.99] = float("inf")
    elif kind == "all -inf":
        x[:] = float("-inf")
    elif kind == "signed zeros":
        x = torch.where(scattered < 0.5, -0.0, 0.0) - (scattered > 0.9).float()
    return x


# Columns: one, fewer than a vector, ragged past whole vectors, the shipped and larger vocabularies.
@requires_kernel
@pytest.mark.parametrize("columns", [1, 5, 16, 37, 2048, 4096])
@pytest.mark.parametrize(
    "kind", ["random", "ties", "nan", "infinities", "all -inf", "signed zeros"]
)
def test_the_kernel_gives_torch_argmax(columns: int, kind: str) -> None:
    x = matrix(64, columns, kind, seed=columns)
    with torch.inference_mode():
        assert argmax_kernel.applies(x)
        assert torch.equal(argmax_kernel.argmax(x), x.argmax(dim=-1))


@requires_kernel
def test_a_strided_matrix_is_read_as_its_values() -> None:
    wide = torch.randn(8, 300)
    x = wide[:, 10:250]  # rows 300 floats apart
    with torch.inference_mode():
        assert torch.equal(argmax_kernel.argmax(x), x.argmax(dim=-1))


def test_it_applies_only_to_float32_on_a_cpu_without_gradients() -> None:
    x = torch.randn(4, 32)
    with torch.inference_mode():
        assert not argmax_kernel.applies(x.bfloat16())
        assert not argmax_kernel.applies(x[0])  # one dimension
        assert not argmax_kernel.applies(torch.zeros(4, 0))
    assert not argmax_kernel.applies(x)  # gradients enabled


@requires_kernel
def test_the_greedy_draw_takes_the_kernel_and_draws_the_argmax(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[torch.Size] = []
    kernel = argmax_kernel.argmax

    def spy(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape)
        return kernel(x)

    monkeypatch.setattr(argmax_kernel, "argmax", spy)
    logits = matrix(6, 2048, "ties", seed=1)
    batch = SamplingBatch([RowSampler(SamplingParams(temperature=0.0)) for _ in range(6)])
    with torch.inference_mode():
        tokens = batch.sample(logits)
    assert calls == [torch.Size([6, 2048])]
    assert torch.equal(tokens, logits.argmax(dim=-1))
