"""PaTH (model/positional/path.py): its scores are q_iᵀ·H_i⋯H_{j+1}·k_j from explicit d × d
Householder products, the cache keeps every key turned by the tokens after it, β = 0 is NoPE,
and PaTH-FoX with its gates open is PaTH. (That the cached forward equals the full forward,
ragged and past the trained length, is tests/model/test_transformer.py's, for every scheme.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model.cache import KVCache
from model.positional.path import BLOCK, householder_pass, unit_lower_inverse
from model.transformer import AttentionRecorder, Transformer
from tests.model.conftest import random_model, random_tokens
from tests.model.test_transformer import assert_rows_match, feed_ragged


def householder(direction: torch.Tensor, strength: torch.Tensor) -> torch.Tensor:
    """H = I − β·w·wᵀ → [d, d]."""
    return torch.eye(direction.shape[0], dtype=direction.dtype) - strength * torch.outer(
        direction, direction
    )


def turned_by(directions, strengths, first: int, last: int, key: torch.Tensor) -> torch.Tensor:
    """H_last ⋯ H_first · key, the product formed matrix by matrix."""
    for s in range(first, last + 1):
        key = householder(directions[s], strengths[s]) @ key
    return key


def test_scores_are_the_explicit_products_of_householder_matrices() -> None:
    generator = torch.Generator().manual_seed(0)
    length, dim = 2 * BLOCK + 7, 8  # two whole blocks and a part of one
    queries, keys, directions = (
        torch.randn(1, 1, length, dim, generator=generator, dtype=torch.float64) for _ in range(3)
    )
    directions = torch.nn.functional.normalize(directions, dim=-1)
    strengths = 2 * torch.rand(1, 1, length, generator=generator, dtype=torch.float64)
    before = torch.ones(length, length, dtype=torch.bool).tril(-1)[None, None]
    moved = householder_pass(queries, keys, directions, strengths, before)
    scores = (queries @ keys.transpose(-2, -1)).float() / math.sqrt(dim) + moved.bias
    w, beta = directions[0, 0], strengths[0, 0]
    for i in range(length):
        for j in range(i + 1):
            expected = queries[0, 0, i] @ turned_by(w, beta, j + 1, i, keys[0, 0, j])
            assert abs(float(scores[0, 0, i, j]) - float(expected) / math.sqrt(dim)) < 1e-5
    for j in range(length):  # after the pass, each key carries every transition after it
        expected = turned_by(w, beta, j + 1, length - 1, keys[0, 0, j])
        torch.testing.assert_close(moved.keys[0, 0, j].double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 16, 31, BLOCK, 100])
def test_unit_lower_inverse_inverts_a_block_system(size: int) -> None:
    """PaTH's own systems (I + strictly_lower(β·W·Wᵀ)), β up to 2: the inverse's product with
    the system is I, within float32 rounding of its largest entries."""
    generator = torch.Generator().manual_seed(size)
    directions = F.normalize(torch.randn(4, size, 8, generator=generator), dim=-1)
    strengths = 2 * torch.rand(4, size, 1, generator=generator)
    system = torch.eye(size) + (strengths * (directions @ directions.transpose(-2, -1))).tril(-1)
    inverse = unit_lower_inverse(system).double()
    exact = torch.linalg.inv(system.double())
    assert torch.equal(inverse.triu(1), torch.zeros_like(inverse))
    torch.testing.assert_close(inverse, exact, atol=1e-5 * float(exact.abs().max()), rtol=0)


def one_system(queries, keys, directions, strengths, before) -> torch.Tensor:
    """The score bias of a whole pass solved as one system (the UT transform, unblocked)."""
    beta = strengths.unsqueeze(-1)
    n = directions.shape[-2]
    ones = torch.ones(n, n, dtype=torch.bool)
    between = (beta * (directions @ directions.transpose(-2, -1))).masked_fill(~ones.tril(-1), 0)
    right = (beta * (directions @ keys.transpose(-2, -1))).masked_fill(~before, 0.0)
    shares = torch.linalg.solve_triangular(
        torch.eye(n) + between, right, upper=False, unitriangular=True
    )
    reach = (queries @ directions.transpose(-2, -1)).masked_fill(~ones.tril(), 0.0)
    return -(reach @ shares) / math.sqrt(queries.shape[-1])


def test_training_inverts_where_inference_solves_and_both_agree() -> None:
    """With gradients the blocks' systems are inverted, without they are solved: the same
    bias either way, and the gradients of one system solved over the whole pass."""
    generator = torch.Generator().manual_seed(9)
    length, dim = 2 * BLOCK + 11, 8
    queries, keys, directions = (torch.randn(2, 3, length, dim, generator=generator) for _ in "qkw")
    directions = F.normalize(directions, dim=-1)
    strengths = 2 * torch.rand(2, 3, length, generator=generator)
    before = torch.ones(length, length, dtype=torch.bool).tril(-1)[None, None]
    solved = householder_pass(queries, keys, directions, strengths, before)
    inputs = [t.clone().requires_grad_() for t in (queries, keys, directions, strengths)]
    inverted = householder_pass(*inputs, before)
    torch.testing.assert_close(inverted.bias, solved.bias, atol=1e-5, rtol=0)
    torch.testing.assert_close(inverted.keys, solved.keys, atol=1e-5, rtol=0)
    reference = [t.clone().requires_grad_() for t in (queries, keys, directions, strengths)]
    weights = torch.randn(solved.bias.shape, generator=generator)
    (inverted.bias * weights).sum().backward()
    (one_system(*reference, before) * weights).sum().backward()
    for got, expected in zip(inputs, reference, strict=True):
        assert got.grad is not None and expected.grad is not None
        torch.testing.assert_close(got.grad, expected.grad, atol=1e-4, rtol=1e-4)


def test_the_cache_keeps_each_key_turned_by_every_later_token() -> None:
    model = random_model("path", seed=1)
    tokens = random_tokens(1, 20, seed=2)
    cache = KVCache(model.config, rows=1, max_length=32)
    recorder = AttentionRecorder(weights=False, scores_of=0)
    with torch.no_grad():
        model(tokens[:, :7], cache)  # a prompt, then one token at a time
        for t in range(7, 20):
            model(tokens[:, t : t + 1], cache)
        model.traced_forward(tokens, recorder)  # the raw keys of layer 0, and its input
    assert recorder.scores is not None and recorder.embedded is not None
    raw = recorder.scores.keys[0]  # [H, T, hd]: nothing turns them in a full forward
    hidden = model.blocks[0].attention_norm(recorder.embedded)
    directions, strengths = model.positional.transitions(0, hidden)
    cached = cache.keys[0, 0, :, :20]  # [H, T, hd]
    for head in range(raw.shape[0]):
        w, beta = directions[0, head].double(), strengths[0, head].double()
        for j in (0, 5, 13, 19):
            expected = turned_by(w, beta, j + 1, 19, raw[head, j].double())
            torch.testing.assert_close(cached[head, j].double(), expected, atol=1e-5, rtol=0)


def nope_twin(model: Transformer) -> Transformer:
    """A ``none`` model with ``model``'s weights (the scheme's own left out)."""
    twin = Transformer(random_model("none").config).eval()
    weights = {k: v for k, v in model.state_dict().items() if not k.startswith("positional.")}
    twin.load_state_dict(weights)
    return twin


def test_with_every_strength_zero_it_is_nope() -> None:
    model = random_model("path", seed=3)
    tokens = random_tokens(2, 30, seed=4)
    with torch.no_grad():
        turning = model(tokens)
        model.positional.strength_bias.fill_(-1e4)  # β = 2·σ(−10⁴) = 0: every H is I
        still = model(tokens)
        nope = nope_twin(model)(tokens)
    torch.testing.assert_close(still, nope, atol=1e-5, rtol=1e-5)
    assert (turning - nope).abs().max() > 1e-2  # the transitions did something before


def test_pathfox_with_its_gates_open_is_path() -> None:
    fox = random_model("pathfox", seed=5)
    path = random_model("path", seed=5)
    tokens = random_tokens(2, 30, seed=6)
    with torch.no_grad():
        weights = {
            name: value
            for name, value in fox.state_dict().items()
            if not name.startswith("positional.forgetting.")
        }
        path.load_state_dict(weights)
        assert (fox(tokens) - path(tokens)).abs().max() > 1e-2  # the gates did something
        fox.positional.forgetting.gate_bias.fill_(1e4)  # log σ(10⁴) = 0: nothing forgotten
        torch.testing.assert_close(fox(tokens), path(tokens), atol=1e-5, rtol=1e-5)


def test_passes_of_several_blocks_cache_as_the_full_forward_does() -> None:
    """Ragged passes longer than a block, then single tokens and a short ragged pass: each
    row's logits equal the full forward's (the generic cache tests stay within one block)."""
    length = 3 * BLOCK + 5
    model = random_model("path", seed=7, context_length=length, max_positions=length)
    tokens = random_tokens(3, length, seed=8)
    cache = KVCache(model.config, rows=3, max_length=length)
    with torch.no_grad():
        full = model(tokens)
        for counts in ([BLOCK + 9, 2 * BLOCK + 3, 1], [1, 1, 1], [BLOCK + 2, 4, 2 * BLOCK]):
            starts = cache.lengths.clone()
            logits = feed_ragged(model, cache, tokens, torch.tensor(counts))
            assert_rows_match(logits, full, starts, torch.tensor(counts))
