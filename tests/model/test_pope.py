"""PoPE (model/positional/pope.py): its scores are the closed form Σ μ_q μ_k cos((s − t)θ − δ)/√d,
they depend on the distance only, and the cache (keys twice a head's width) decodes it as the
full forward does, ragged and past the trained length."""

from __future__ import annotations

import math

import torch

from model.transformer import AttentionRecorder, Transformer
from tests.model.conftest import random_model, random_tokens


def layer_scores(model: Transformer, tokens: torch.Tensor, layer: int = 0) -> tuple:
    """Layer ``layer``'s scores [H, T, T] as attention computes them (turned q·k over SDPA's
    1/√(2d)), and the queries and keys before the turn [H, T, d] each."""
    recorder = AttentionRecorder(weights=False, scores_of=layer)
    with torch.no_grad():
        model.traced_forward(tokens, recorder)
    parts = recorder.scores
    assert parts is not None and parts.unrotated is not None
    queries, keys = parts.queries[0], parts.keys[0]
    scores = queries @ keys.transpose(-2, -1) / math.sqrt(queries.shape[-1])
    heads = queries.shape[0]
    return scores, parts.unrotated[0, :heads], parts.unrotated[0, heads:]


def closed_form(
    model: Transformer, queries: torch.Tensor, keys: torch.Tensor, magnitude
) -> torch.Tensor:
    """Σ_c |q_c|·|k_c|·cos((s − t)·θ_c − δ_c)/√d → [H, T, T], straight from the definition."""
    scheme = model.positional
    length, head_dim = queries.shape[1], queries.shape[2]
    theta = scheme.frequencies.float()  # [d]
    distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]  # s − t
    delta = scheme.phase_bias[0].detach().clamp(-2 * math.pi, 0)[:, None, None, :]  # [H, 1, 1, d]
    phase = torch.cos(distance[None, :, :, None] * theta - delta)  # [H, T, T, d]
    products = magnitude(queries)[:, :, None, :] * magnitude(keys)[:, None, :, :]
    return (products * phase).sum(-1) / math.sqrt(head_dim)


def test_with_no_phase_bias_and_magnitudes_abs_it_is_the_closed_form() -> None:
    model = random_model("pope", seed=1)
    with torch.no_grad():
        model.positional.phase_bias.zero_()
    model.positional.magnitude = torch.abs
    scores, queries, keys = layer_scores(model, random_tokens(1, 40, seed=2))
    torch.testing.assert_close(
        scores, closed_form(model, queries, keys, torch.abs), atol=2e-5, rtol=1e-5
    )


def test_with_softplus_and_a_learned_phase_bias_it_is_the_closed_form_too() -> None:
    model = random_model("pope", seed=3)  # randomise() draws the phase bias
    assert model.positional.phase_bias.abs().max() > 0.1
    scores, queries, keys = layer_scores(model, random_tokens(1, 40, seed=4))
    expected = closed_form(model, queries, keys, torch.nn.functional.softplus)
    torch.testing.assert_close(scores, expected, atol=2e-5, rtol=1e-5)


def test_a_score_depends_on_the_distance_only() -> None:
    """The same query and key vectors at positions shifted by 37 give the same scores."""
    model = random_model("pope", seed=5)
    scheme = model.positional
    generator = torch.Generator().manual_seed(6)
    vectors = torch.randn(1, 8, 10, model.config.head_dim, generator=generator)  # 4 q + 4 k heads
    positions = torch.arange(10).unsqueeze(0)
    turned = [scheme.turn(vectors, scheme.rotation(positions + shift), 4, 1) for shift in (0, 37)]
    scores = [t[:, :4] @ t[:, 4:].transpose(-2, -1) for t in turned]
    torch.testing.assert_close(scores[0], scores[1], atol=1e-4, rtol=1e-5)
    assert turned[0].shape[-1] == 2 * model.config.head_dim == model.config.key_dim


def test_its_geometry_is_each_components_phase_and_depends_on_the_distance_only() -> None:
    """``rotate`` (what ``ordinal geometry`` reads) turns each component by its phase alone:
    the dot product of two positions' representations is a function of their distance."""
    scheme = random_model("pope", seed=9).positional
    x = torch.ones(1, 1, 30, scheme.config.head_dim)
    turned = scheme.rotate(x, torch.arange(30).unsqueeze(0))[0, 0]  # [T, 2·hd]
    assert turned.shape[-1] == 2 * scheme.config.head_dim
    gram = turned @ turned.T
    torch.testing.assert_close(gram[3, 9], gram[20, 26])  # distance 6, twice
    expected = torch.cos(6 * scheme.frequencies).sum().float()
    torch.testing.assert_close(gram[3, 9], expected, atol=1e-5, rtol=1e-5)
