"""The temperature-only draw kernel (model/kernels/draw.cpp) draws by the inverse CDF as the
torch ops do, never lands on a token without mass, and fails a row whose uniform is not in
[0, 1)."""

from __future__ import annotations

import math

import pytest
import torch

from model.kernels import draw
from model.sampling import _draw_inverse_cdf

# Every variant this CPU runs (tests/conftest.py); a kernel that fails to build fails here.
pytestmark = pytest.mark.usefixtures("every_isa")


@pytest.mark.parametrize(
    ("rows", "vocab", "spread"), [(1, 2048, 3), (5, 7, 3), (32, 16, 3), (3, 33, 3), (4, 2048, 40)]
)
def test_it_draws_the_token_the_torch_ops_draw(rows: int, vocab: int, spread: float) -> None:
    """Every uniform not within a rounding of a boundary of the float64 CDF draws the torch
    path's token (softmax of logits / T, cumulative sum, search). A spread of 40 puts most
    scaled logits past where float32's exp ends (its weights are 0, as torch's)."""
    generator = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=generator) * spread
    temperature = torch.rand(rows, generator=generator) + 0.2
    cdf = (logits.double() / temperature.double()[:, None]).softmax(-1).cumsum(-1)
    checked = 0
    for _ in range(100):
        uniforms = torch.rand(rows, generator=generator)
        near = (cdf - uniforms.double()[:, None]).abs().min(dim=-1).values < 1e-5
        expected = _draw_inverse_cdf((logits / temperature[:, None]).softmax(-1), None, uniforms)
        got = draw.tempered(logits, temperature, uniforms)
        assert got.dtype is torch.long and got.shape == (rows,)
        assert torch.equal(got[~near], expected[~near])
        checked += int((~near).sum())
    assert checked > 90 * rows


def test_a_rows_draw_is_the_same_alone_and_in_a_batch() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 300, generator=generator)
    temperature, uniforms = torch.rand(9, generator=generator) + 0.5, torch.rand(9)
    together = draw.tempered(logits, temperature, uniforms)
    for row in range(9):
        alone = draw.tempered(
            logits[row : row + 1], temperature[row : row + 1], uniforms[row : row + 1]
        )
        assert alone.item() == together[row].item()


def test_the_ends_of_the_uniform_land_on_tokens_with_mass() -> None:
    """Uniform 0 draws the first token with mass, the largest float32 below 1 the last one;
    tokens forbidden (−inf, as a grammar masks them) are never drawn."""
    logits = torch.randn(1, 40)
    logits[0, :3] = -math.inf
    logits[0, -5:] = -math.inf
    one = torch.ones(1)
    assert draw.tempered(logits, one, torch.zeros(1)).item() == 3
    assert draw.tempered(logits, one, torch.tensor([1 - 2**-24])).item() == 34


@pytest.mark.parametrize("uniform", [1.5, 2.0])
def test_a_uniform_outside_the_unit_interval_draws_past_the_vocabulary(uniform: float) -> None:
    """The sampler then fails that row (SamplingBatch.draw's range check), as with torch."""
    logits = torch.randn(2, 10)
    tokens = draw.tempered(logits, torch.ones(2), torch.tensor([uniform, 0.5]))
    assert tokens[0].item() == 10 and 0 <= tokens[1].item() < 10


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 17, 36])  # the first block, a middle one, the last lane
def test_the_raw_draw_fails_a_row_with_a_non_finite_logit_and_draws_the_others(
    bad: float, where: int
) -> None:
    generator = torch.Generator().manual_seed(where)
    logits = torch.randn(3, 37, generator=generator)
    temperature, uniforms = torch.rand(3, generator=generator) + 0.5, torch.rand(3)
    clean, failed = draw.tempered_raw(logits, temperature, uniforms)
    assert failed == 0 and torch.equal(clean, draw.tempered(logits, temperature, uniforms))
    logits[1, where] = bad
    tokens, failed = draw.tempered_raw(logits, temperature, uniforms)
    assert failed == 1 and tokens[1].item() == -1
    assert tokens[0].item() == clean[0].item() and tokens[2].item() == clean[2].item()


def test_the_raw_draw_counts_a_uniform_outside_the_unit_interval() -> None:
    tokens, failed = draw.tempered_raw(torch.randn(2, 10), torch.ones(2), torch.tensor([1.5, 0.5]))
    assert failed == 1 and tokens[0].item() == 10 and 0 <= tokens[1].item() < 10
