"""Stick-breaking attention (model/positional/stickbreaking.py): its weights are the paper's
product, each row sums to at most 1, the model attends with exactly those weights, and the cache
decodes it as the full forward does, ragged and past the trained length."""

from __future__ import annotations

import torch

from model.transformer import AttentionRecorder
from tests.model.conftest import random_model, random_tokens


def reference_weights(scores: torch.Tensor) -> torch.Tensor:
    """A_ij = σ(z_ij) ∏_{j<t≤i} (1 − σ(z_it)) for j ≤ i, straight from the definition, in
    float64: ``scores`` [T, T] → [T, T]."""
    beta = torch.sigmoid(scores.double())
    length = scores.shape[0]
    weights = torch.zeros(length, length, dtype=torch.float64)
    for i in range(length):
        for j in range(i + 1):
            weights[i, j] = beta[i, j] * torch.prod(1 - beta[i, j + 1 : i + 1])
    return weights


def test_the_weights_are_the_papers_product_and_sum_to_at_most_one() -> None:
    scheme = random_model("stickbreaking", seed=1).positional
    generator = torch.Generator().manual_seed(2)
    scores = torch.randn(2, 3, 12, 12, generator=generator) * 3
    allowed = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
    weights = scheme.attention_weights(scores, allowed)
    for batch in range(2):
        for head in range(3):
            expected = reference_weights(scores[batch, head]).float()
            torch.testing.assert_close(weights[batch, head], expected, atol=1e-6, rtol=1e-5)
    sums = weights.sum(-1)
    assert (sums <= 1 + 1e-6).all() and (sums < 0.999).any()  # what is left goes nowhere
    assert not weights.masked_select(~allowed.expand_as(weights)).any()


def test_the_latest_key_that_claims_everything_takes_everything() -> None:
    """A key whose σ(score) is 1 leaves nothing to the keys before it: recency without
    positions."""
    scheme = random_model("stickbreaking", seed=3).positional
    scores = torch.zeros(1, 1, 1, 6)
    scores[..., 2] = 50.0  # σ ≈ 1
    weights = scheme.attention_weights(scores, torch.ones(1, 1, 1, 6, dtype=torch.bool))
    assert weights[0, 0, 0, 2] > 0.06 and weights[0, 0, 0, :2].max() < 1e-20
    # the keys after it still take their shares first: σ(0) = ½ each, so ½, ¼, ⅛ of it
    torch.testing.assert_close(weights[0, 0, 0, 3:], torch.tensor([0.125, 0.25, 0.5]))


def test_the_model_attends_with_those_weights() -> None:
    model = random_model("stickbreaking", seed=4)
    tokens = random_tokens(1, 20, seed=5)
    recorder = AttentionRecorder()
    with torch.no_grad():
        model.traced_forward(tokens, recorder)
    for weights in recorder.weights:  # [1, H, T, T]
        assert (weights.sum(-1) <= 1 + 1e-5).all()
        assert not weights.triu(1).any()
