"""Every kernel variant this CPU runs computes the same bits (simd.h: a fixed 16-lane width, a
fused multiply-add on every ISA, contraction off): each projection, each draw, CoPE's bias and
its gradient, and every scheme's prefill, decode steps and cache. The AMX tile path sums in
another order by design, so it is off here (test_tiles.py holds it to float32's accuracy)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

import model.cpu as cpu
import model.kernels as kernels
from model.kernels import argmax as argmax_kernel
from model.kernels import cope as cope_kernel
from model.kernels import draw as draw_kernel
from model.kernels import linear as linear_kernel
from tests.model.conftest import ALL_SCHEMES, random_model
from tests.model.kernels.test_decode_step import narrowed, ragged_batch
from tests.model.kernels.test_linear import column_major_linear

pytestmark = pytest.mark.skipif(
    len(cpu.runnable()) < 2, reason="this CPU runs one variant: nothing to compare"
)


@pytest.fixture(autouse=True)
def vector_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(linear_kernel, "tiles_ready", lambda: False)
    yield


def on_every_variant(run: Callable[[], object]) -> dict[str, object]:
    """``run()``'s result under each variant this CPU runs, and under the fastest first."""
    results = {}
    for isa in cpu.runnable():
        with kernels.using(isa):
            results[isa] = run()
    return results


def assert_same_bits(results: dict[str, object]) -> None:
    (first_isa, first), *others = results.items()
    for isa, result in others:
        flat_first = first if isinstance(first, (list, tuple)) else [first]
        flat = result if isinstance(result, (list, tuple)) else [result]
        assert len(flat) == len(flat_first)
        for index, (a, b) in enumerate(zip(flat_first, flat, strict=True)):
            assert torch.equal(a, b), f"{isa} differs from {first_isa} in result {index}"


@pytest.mark.parametrize("narrow", [False, True], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_every_variant_decodes_every_scheme_to_the_same_bits(scheme: str, narrow: bool) -> None:
    """Ragged prompts prefilled (their projections in the kernel), then decode steps in the
    decode-step kernel: the logits of every step and the whole cache, bit for bit."""

    def decode() -> list[torch.Tensor]:
        model = random_model(scheme, seed=4)
        if narrow:
            narrowed(model)
        cache, tokens = ragged_batch(model, rows=12)
        steps = []
        with torch.inference_mode():
            for _ in range(3):
                logits = model(tokens, cache, last_only=True)
                steps.append(logits)
                tokens = logits.argmax(-1, keepdim=True)
        return [*steps, cache.keys, cache.values, cache.states]

    assert_same_bits(on_every_variant(decode))


@pytest.mark.parametrize("narrow", [False, True], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("inputs", "outputs"), [(128, 2048), (300, 77), (512, 128), (7, 5)])
def test_every_variant_projects_to_the_same_bits(inputs: int, outputs: int, narrow: bool) -> None:
    linear = column_major_linear(inputs, outputs, bias=True, seed=outputs, narrow=narrow)
    x = torch.randn(64, inputs)

    def project() -> list[torch.Tensor]:
        with torch.no_grad():
            return [linear(x[:rows]) for rows in (1, 2, 5, 6, 7, 13, 64)]

    assert_same_bits(on_every_variant(project))


def test_every_variant_draws_and_picks_the_same_tokens() -> None:
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(32, 2051, generator=generator) * 4
    logits[3, 100] = float("nan")
    temperature = torch.rand(32, generator=generator) + 0.1
    uniforms = torch.rand(32, generator=generator)

    def draw() -> list[torch.Tensor]:
        with torch.inference_mode():
            tokens, failed = draw_kernel.tempered_raw(logits, temperature, uniforms)
            return [tokens, torch.tensor(failed), argmax_kernel.argmax(logits)]

    assert_same_bits(on_every_variant(draw))


def test_every_variant_gives_copes_bias_and_gradient_the_same_bits() -> None:
    generator = torch.Generator().manual_seed(6)
    scores = torch.randn(2, 3, 24, 24, generator=generator) * 3
    rows = torch.randn(2, 3, 24, 16, generator=generator)
    allowed = torch.ones(24, 24, dtype=torch.bool).tril()[None, None]
    grad = torch.randn(2, 3, 24, 24, generator=generator)

    def cope() -> list[torch.Tensor]:
        bias = cope_kernel.cope_bias(scores, allowed, rows, 0.25)
        d_scores, d_rows = cope_kernel.cope_bias_backward(grad, scores, allowed, rows, 0.25)
        return [bias, d_scores, d_rows]

    assert_same_bits(on_every_variant(cope))
