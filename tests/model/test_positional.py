"""Each positional scheme has the mathematical property it is chosen for, and table schemes
refuse positions past their table instead of wrapping or failing inside torch."""

from __future__ import annotations

import pytest
import torch

from model.cache import KVCache
from model.positional import TABLE_SCHEMES, PositionOutOfRange, build_scheme
from model.positional.alibi import alibi_slopes
from model.positional.t5 import relative_position_bucket
from model.transformer import Attention, AttentionMask, Transformer
from tests.model.conftest import ALL_SCHEMES, random_model, random_tokens, randomise, tiny_config

NO_MASK = AttentionMask(None, is_causal=False)


def run_blocks_without_mask(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """The model's layers with full (bidirectional) attention → logits [B, T, V]."""
    x = model.token_embedding(tokens)
    vectors = model.positional.embedding(torch.arange(tokens.shape[1]).unsqueeze(0))
    if vectors is not None:
        x = x + vectors
    for layer, block in enumerate(model.blocks):
        x = block(x, None, NO_MASK, None, None, layer)
    return model.lm_head(model.final_norm(x))


def random_permutations(length: int, count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randperm(length, generator=generator) for _ in range(count)]


class TestTheoremOneForNoPE:
    """Theorem 1 of the geometry paper, stated for what this decoder computes.

    (a) Without a mask and without positions, self-attention is permutation-EQUIVARIANT:
        f(x_σ) = f(x)_σ. Norms and MLPs act token by token, so a stack of such blocks is too.
    (b) Under the causal mask the model is NOT equivariant, but with no positions a ONE-layer
        model's output at position t depends only on token t and the multiset of tokens 0..t-1;
        in particular the last position's output is invariant to any permutation of the prefix.
    (c) (b) does not extend to two layers: layer 2 reads layer-1 states of earlier positions,
        each of which depends on its own prefix, and permuting the prefix changes those.
    (d) What does survive at any depth: in a constant sequence every position sees identical
        keys and values, so NoPE gives every position the same output.
    A positional scheme (sinusoidal here) breaks (a) and (b).
    """

    def test_a_attention_without_mask_or_positions_is_equivariant(self) -> None:
        torch.manual_seed(0)
        attention = Attention(tiny_config("none")).eval()
        x = torch.randn(2, 12, 32)
        for perm in random_permutations(12, 5, seed=1):
            permuted_out = attention(x[:, perm], None, NO_MASK, None, None, 0)
            out_permuted = attention(x, None, NO_MASK, None, None, 0)[:, perm]
            torch.testing.assert_close(permuted_out, out_permuted, atol=1e-5, rtol=0)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            torch.testing.assert_close(
                sdpa(x[:, perm], x[:, perm], x[:, perm]), sdpa(x, x, x)[:, perm]
            )

    def test_a_whole_stack_without_mask_is_equivariant_and_positions_break_it(self) -> None:
        tokens = random_tokens(2, 12, seed=2)
        nope, sinusoidal = random_model("none", seed=3), random_model("sinusoidal", seed=3)
        with torch.no_grad():
            for perm in random_permutations(12, 5, seed=4):
                original = run_blocks_without_mask(nope, tokens)
                permuted = run_blocks_without_mask(nope, tokens[:, perm])
                torch.testing.assert_close(permuted, original[:, perm], atol=1e-4, rtol=0)
                moved = perm != torch.arange(12)
                original = run_blocks_without_mask(sinusoidal, tokens)[:, perm]
                permuted = run_blocks_without_mask(sinusoidal, tokens[:, perm])
                assert (permuted - original)[:, moved].abs().max() > 0.1

    def test_b_one_causal_layer_ignores_the_order_of_the_prefix(self) -> None:
        tokens = random_tokens(3, 10, seed=5)
        one_layer = random_model("none", seed=6, n_layers=1)
        with_positions = random_model("sinusoidal", seed=6, n_layers=1)
        with torch.no_grad():
            for perm in random_permutations(9, 5, seed=7):
                shuffled = torch.cat((tokens[:, perm], tokens[:, 9:]), dim=1)
                torch.testing.assert_close(
                    one_layer(shuffled, last_only=True),
                    one_layer(tokens, last_only=True),
                    atol=1e-5,
                    rtol=0,
                )
                change = with_positions(shuffled, last_only=True) - with_positions(
                    tokens, last_only=True
                )
                assert change.abs().max() > 1e-2

    def test_c_two_causal_layers_see_the_order_of_the_prefix(self) -> None:
        tokens = random_tokens(3, 10, seed=8)
        two_layers = random_model("none", seed=9, n_layers=2)
        with torch.no_grad():
            for perm in random_permutations(9, 5, seed=10):
                if torch.equal(perm, torch.arange(9)):
                    continue
                shuffled = torch.cat((tokens[:, perm], tokens[:, 9:]), dim=1)
                change = two_layers(shuffled, last_only=True) - two_layers(tokens, last_only=True)
                assert change.abs().max() > 1e-3

    def test_d_a_constant_sequence_gives_every_position_the_same_output(self) -> None:
        model = random_model("none", seed=11, n_layers=3)
        tokens = random_tokens(4, 1, seed=12).expand(4, 15)
        with torch.no_grad():
            logits = model(tokens)
        torch.testing.assert_close(logits, logits[:, :1].expand_as(logits), atol=1e-5, rtol=0)


def sinusoidal_vectors(positions: torch.Tensor, d_model: int = 64) -> torch.Tensor:
    """The vectors the sinusoidal scheme adds, taken from the scheme module → [N, d_model]."""
    scheme = build_scheme(tiny_config("sinusoidal", d_model=d_model))
    return scheme.embedding(positions.unsqueeze(0))[0].double()


def shift_matrix(k: int, d_model: int = 64) -> torch.Tensor:
    """M_k, built from PE(k) alone: since PE(0) has (sin, cos) = (0, 1) in each pair, PE(k)'s
    pair (s, c) is the pair's rotation by k steps, [[c, s], [-s, c]] on (sin, cos)."""
    pairs = sinusoidal_vectors(torch.tensor([k]), d_model)[0].view(-1, 2)
    blocks = [torch.tensor([[c, s], [-s, c]]) for s, c in pairs.tolist()]
    return torch.block_diag(*blocks).double()


def test_sinusoidal_shift_is_one_block_diagonal_rotation_for_every_position() -> None:
    generator = torch.Generator().manual_seed(13)
    positions = torch.randint(0, 5000, (300,), generator=generator)
    for k in torch.randint(1, 2000, (20,), generator=generator).tolist():
        rotation = shift_matrix(k)
        assert torch.allclose(rotation @ rotation.T, torch.eye(64, dtype=torch.float64))
        shifted = sinusoidal_vectors(positions + k)
        predicted = sinusoidal_vectors(positions) @ rotation.T
        assert (shifted - predicted).abs().max() < 1e-6


def test_sinusoidal_dot_product_depends_only_on_distance() -> None:
    generator = torch.Generator().manual_seed(14)
    i, j = torch.randint(0, 3000, (2, 500), generator=generator)
    k = torch.randint(0, 1000, (500,), generator=generator)
    forward = (sinusoidal_vectors(i) * sinusoidal_vectors(i + k)).sum(-1)  # distance +k
    backward = (sinusoidal_vectors(j + k) * sinusoidal_vectors(j)).sum(-1)  # distance -k
    assert (forward - backward).abs().max() < 1e-5
    assert forward.std() > 1.0  # the dot product does vary with the distance


ROPE_SETTINGS = [
    {},
    {"rotary_fraction": 0.5},
    {"scaling": "ntk", "scaling_factor": 4.0},
    {"scaling": "linear", "scaling_factor": 4.0},
    {"rotary_fraction": 0.25, "scaling": "ntk", "scaling_factor": 2.0},  # one pair rotated
]


@pytest.mark.parametrize("settings", ROPE_SETTINGS, ids=str)
def test_rope_score_depends_only_on_relative_position(settings: dict) -> None:
    config = tiny_config("rope", d_model=32, n_heads=4, positional={"scheme": "rope", **settings})
    scheme = build_scheme(config)
    head_dim, count = config.head_dim, 400
    generator = torch.Generator().manual_seed(15)
    m, n, shift = torch.randint(0, 2000, (3, count), generator=generator)
    queries = torch.randn(1, 1, count, head_dim, generator=generator)
    keys = torch.randn(1, 1, count, head_dim, generator=generator)

    def scores(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        rotated_q = scheme.rotate(queries, query_positions.unsqueeze(0))
        rotated_k = scheme.rotate(keys, key_positions.unsqueeze(0))
        return (rotated_q * rotated_k).sum(-1).flatten()

    torch.testing.assert_close(scores(m + shift, n + shift), scores(m, n), atol=1e-4, rtol=0)
    unrotated = (queries * keys).sum(-1).flatten()
    assert (scores(m, n) - unrotated).abs().max() > 0.5  # positions do move the score
    rotary_dim = scheme.rotary_dim
    passed = scheme.rotate(queries, m.unsqueeze(0))[..., rotary_dim:]
    assert torch.equal(passed, queries[..., rotary_dim:])


def test_alibi_slopes_follow_the_paper() -> None:
    expected = {
        8: [2.0**-e for e in range(1, 9)],
        # closest power of two (4): 2^-2 … 2^-8, then every other slope of 8 heads: 2^-1, 2^-3
        6: [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3],
        # closest power of two (8): 2^-1 … 2^-8, then every other slope of 16 heads
        12: [2.0**-e for e in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5],
        1: [2.0**-8],
        16: [2.0 ** (-e / 2) for e in range(1, 17)],
    }
    for heads, slopes in expected.items():
        torch.testing.assert_close(alibi_slopes(heads), torch.tensor(slopes), rtol=1e-6, atol=0)


def test_alibi_bias_is_minus_slope_times_distance() -> None:
    config = tiny_config("alibi", d_model=48, n_heads=6)
    scheme = build_scheme(config)
    generator = torch.Generator().manual_seed(16)
    queries = torch.randint(0, 500, (2, 7), generator=generator)
    keys = torch.arange(500)
    bias = scheme.attention_bias(queries, keys)  # [B, H, Tq, Tk]
    distance = (queries.unsqueeze(-1) - keys).unsqueeze(1).float()
    torch.testing.assert_close(bias, -alibi_slopes(6).view(1, 6, 1, 1) * distance)


@pytest.mark.parametrize(
    ("num_buckets", "max_distance"), [(32, 128), (8, 24), (16, 64), (10, 100), (2, 8), (64, 1000)]
)
def test_t5_buckets(num_buckets: int, max_distance: int) -> None:
    distances = torch.arange(4 * max_distance)
    buckets = relative_position_bucket(distances, num_buckets, max_distance)
    assert int(buckets[0]) == 0
    exact = num_buckets // 2
    assert torch.equal(buckets[:exact], distances[:exact])  # short distances: one bucket each
    assert (buckets.diff() >= 0).all()  # never decreases with distance
    assert (buckets[max_distance:] == num_buckets - 1).all()
    assert buckets.min() >= 0 and buckets.max() == num_buckets - 1


def test_t5_bias_reads_the_bucket_of_each_distance() -> None:
    model = random_model("t5", seed=17)
    scheme = model.positional
    queries = torch.tensor([[0, 5, 40]])
    bias = scheme.attention_bias(queries, torch.arange(41))  # [1, H, 3, 41]
    distance = (queries.unsqueeze(-1) - torch.arange(41))[0]
    buckets = relative_position_bucket(distance, 8, 24)
    torch.testing.assert_close(bias[0], scheme.bias_table[buckets].permute(2, 0, 1))


@pytest.mark.parametrize("scheme", TABLE_SCHEMES)
def test_table_schemes_refuse_positions_past_the_table_in_a_full_forward(scheme: str) -> None:
    model = random_model(scheme, seed=18)  # max_positions 64
    with torch.no_grad():
        assert model(random_tokens(1, 64, seed=19)).shape == (1, 64, 320)
        with pytest.raises(
            PositionOutOfRange, match=rf"position 64 .*'{scheme}'.*max_positions=64"
        ):
            model(random_tokens(1, 65, seed=19))


@pytest.mark.parametrize("scheme", TABLE_SCHEMES)
def test_table_schemes_refuse_positions_past_the_table_through_the_cache(scheme: str) -> None:
    model = random_model(scheme, seed=20)
    tokens = random_tokens(2, 70, seed=21)
    cache = KVCache(model.config, 2, 80)  # longer than the table: the scheme must object
    with torch.no_grad():
        model(tokens[:, :62], cache, new_counts=torch.tensor([62, 60]))
        # both rows reach the last position; row 0's padding (which would be 64, 65) must not
        # count as positions
        model(tokens[:, 60:64], cache, new_counts=torch.tensor([2, 4]))
        assert cache.lengths.tolist() == [64, 64]
        with pytest.raises(PositionOutOfRange, match="position 64"):
            model(tokens[:, 64:65], cache)
        with pytest.raises(PositionOutOfRange, match="position 65"):
            model(tokens[1:, 64:66], cache, rows=slice(1, 2))
        assert cache.lengths.tolist() == [64, 64]  # nothing was written


def test_binary_refuses_positions_past_its_bits() -> None:
    config = tiny_config("binary", positional={"scheme": "binary", "bits": 5, "scale": 2.0})
    model = randomise(Transformer(config), seed=22).eval()
    positions = torch.arange(32).unsqueeze(0)
    bits = model.positional.embedding(positions)[0, :, :5]  # dims ≥ 5 are zero padding
    expected = [[2.0 * ((p >> bit) & 1) for bit in range(5)] for p in range(32)]
    assert torch.equal(bits, torch.tensor(expected))
    with torch.no_grad():
        model(random_tokens(1, 32, seed=23))
        with pytest.raises(PositionOutOfRange, match=r"position 32 .*max_positions=32"):
            model(random_tokens(1, 33, seed=23))


@pytest.mark.parametrize("scheme", [s for s in ALL_SCHEMES if s not in (*TABLE_SCHEMES, "binary")])
def test_formula_schemes_accept_positions_past_max_positions(scheme: str) -> None:
    model = random_model(scheme, seed=24)
    with torch.no_grad():
        logits = model(random_tokens(1, 100, seed=25))  # max_positions is 64
    assert torch.isfinite(logits).all()
