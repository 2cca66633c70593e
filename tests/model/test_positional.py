"""Each positional scheme has the mathematical property it is chosen for and computes the values
of its source's formula, and table schemes refuse positions past their table instead of wrapping
or failing inside torch.

Reference values are computed here, independently of model.positional, from the defining formula
of each scheme (transcribed below with its source: RoFormer, position interpolation, NTK-aware
scaling, Mesh TensorFlow's T5 buckets, the ALiBi authors' slopes, Vaswani et al.'s sinusoids).
"""

from __future__ import annotations

import math
import re
import typing
from pathlib import Path

import pytest
import torch

import model.positional
from model.cache import KVCache
from model.config import ConfigError
from model.positional import (
    SCHEMES,
    TABLE_SCHEMES,
    PositionOutOfRange,
    build_scheme,
    positions_table,
    scheme_params,
)
from model.positional import rope as rope_module
from model.positional.alibi import alibi_slopes
from model.positional.base import PositionalScheme, SchemeKind
from model.positional.binary import BinaryParams
from model.positional.lowrank import LowRankParams
from model.positional.mds import MdsParams
from model.positional.rope import RopeParams, rope_angles
from model.positional.rotation import apply_rotation
from model.positional.sinusoidal import position_angles, sinusoidal_encoding, sinusoidal_table
from model.positional.t5 import T5Params, relative_position_bucket
from model.transformer import Attention, AttentionMask, LayerInputs, Transformer
from tests.model.conftest import ALL_SCHEMES, random_model, random_tokens, randomise, tiny_config
from tests.model.test_layout import runtime_imports

NO_MASK = AttentionMask(None, is_causal=False)


def run_blocks_without_mask(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """The model's layers with full (bidirectional) attention → logits [B, T, V]."""
    x = model.embed(tokens, torch.arange(tokens.shape[1]).unsqueeze(0))
    for layer, block in enumerate(model.blocks):
        x = block(x, LayerInputs(None, NO_MASK), layer)
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
            permuted_out = attention(x[:, perm], LayerInputs(None, NO_MASK), 0)
            out_permuted = attention(x, LayerInputs(None, NO_MASK), 0)[:, perm]
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


def test_alibi_scale_multiplies_every_slope_and_must_be_positive() -> None:
    positions = torch.arange(9).unsqueeze(0)
    paper = build_scheme(tiny_config("alibi", d_model=48, n_heads=6))
    scaled_config = {"scheme": "alibi", "scale": 4.0}
    scaled = build_scheme(tiny_config("alibi", d_model=48, n_heads=6, positional=scaled_config))
    torch.testing.assert_close(
        scaled.attention_bias(positions, positions[0]),
        4.0 * paper.attention_bias(positions, positions[0]),
    )
    with pytest.raises(ConfigError, match=r"positional\.scale"):
        tiny_config("alibi", positional={"scheme": "alibi", "scale": 0.0})


def test_t5_alibi_init_starts_as_alibi_at_every_exact_distance() -> None:
    """With ``alibi_init`` s, a fresh t5 table is ALiBi's bias (slopes × s): exactly at the
    distances with a bucket of their own, at the bucket's mean distance past them."""
    settings = {"scheme": "t5", "num_buckets": 8, "max_distance": 24, "alibi_init": 4.0}
    t5 = build_scheme(tiny_config("t5", n_heads=4, positional=settings))
    alibi = build_scheme(
        tiny_config("alibi", n_heads=4, positional={"scheme": "alibi", "scale": 4.0})
    )
    positions = torch.arange(30).unsqueeze(0)
    t5_bias = t5.attention_bias(positions, positions[0])[0]  # [H, Tq, Tk]
    alibi_bias = alibi.attention_bias(positions, positions[0])[0]
    exact = torch.arange(4)  # num_buckets / 2 distances with a bucket each
    torch.testing.assert_close(t5_bias[:, 10, 10 - exact], alibi_bias[:, 10, 10 - exact])
    far = t5_bias[:, 29, : 29 - 4]  # distances ≥ 5: log buckets, decreasing with the distance
    assert (far[:, :-1] <= far[:, 1:]).all() and (far < alibi_bias[:, 29, 29 - 3 : 29 - 2]).all()
    with pytest.raises(ConfigError, match=r"positional\.alibi_init"):
        tiny_config("t5", positional={"scheme": "t5", "alibi_init": -1.0})


@pytest.mark.parametrize("scheme", ["alibi", "t5"])
def test_score_bias_depends_only_on_query_minus_key(scheme: str) -> None:
    positional = random_model(scheme, seed=26).positional  # t5: a random bucket table
    generator = torch.Generator().manual_seed(27)
    queries = torch.randint(0, 300, (3, 9), generator=generator)
    keys = torch.randint(0, 300, (40,), generator=generator)
    for shift in torch.randint(1, 2000, (4,), generator=generator).tolist():
        shifted = positional.attention_bias(queries + shift, keys + shift)
        torch.testing.assert_close(shifted, positional.attention_bias(queries, keys))
    assert positional.attention_bias(queries, keys).std() > 0  # the distance does matter


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


def test_schemes_import_only_each_other_the_config_error_and_the_kernels() -> None:
    # Pure tensor code, and no cycle with model.config (which imports the registry); the
    # kernels (model/kernels: CoPE's) import nothing of the model but each other and model.cpu.
    folders = {
        "model.positional": Path(model.positional.__file__).parent,
        "model.kernels": Path(model.positional.__file__).parent.parent / "kernels",
    }
    for package, folder in folders.items():
        for path in sorted(folder.glob("*.py")):
            ours = {name for name in runtime_imports(path) if name.split(".")[0] == "model"}
            own = {name for name in ours if name.startswith(package)}
            others = {
                "model.positional": {"model.errors", "model.kernels"},
                "model.kernels": {"model.cpu"},  # which variant this CPU runs (no torch)
            }[package]
            # runtime_imports names each imported name too (model.errors.ConfigError)
            outside = ours - own
            assert all(
                any(name == allowed or name.startswith(f"{allowed}.") for allowed in others)
                for name in outside
            ), (path.name, outside)


# --------------------------------------------------------------------------------- every scheme


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_every_scheme_keeps_its_config_parameters_and_table_size(scheme: str) -> None:
    config = tiny_config(scheme)
    built = build_scheme(config)
    assert built.name == scheme
    assert built.config is config
    assert built.params == scheme_params(config)
    assert f"scheme={scheme!r}, params={built.params}" in repr(built)
    if scheme in TABLE_SCHEMES:
        assert built.max_positions == config.max_positions
    elif scheme == "binary":
        assert built.max_positions == 2 ** config.positional["bits"]
    else:
        assert built.max_positions is None  # formula schemes accept any position


# The hook each kind fills (model/positional/base.py's (a)-(e)); "none" fills none.
KIND_HOOKS = {  # a kind's hooks: a scheme of that kind fills at least one
    "added": ("embedding",),
    "rotation": ("rotation",),
    "bias": ("attention_bias",),
    "data-dependent": ("layer_bias", "move_keys"),
    "weights": ("attention_weights",),
}


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_every_scheme_declares_its_kind_and_claim_and_the_kind_is_its_hook(scheme: str) -> None:
    """/v1/models sends both, and the playground shows the claim beside its experiments: each
    class declares its own (not its base's), the claim one line, the kind the hook it fills."""
    cls = SCHEMES[scheme]
    assert "kind" in vars(cls) and "claim" in vars(cls), cls.__name__
    assert cls.kind in typing.get_args(SchemeKind)
    assert cls.claim.strip() and "\n" not in cls.claim
    filled = {
        kind
        for kind, hooks in KIND_HOOKS.items()
        if any(getattr(cls, hook) is not getattr(PositionalScheme, hook) for hook in hooks)
    }
    window = {"bias"} if scheme == "irope" else set()  # irope's sliding window masks by distance
    assert filled == ({cls.kind} - {"none"}) | window, (cls.kind, filled)
    assert cls.data_dependent == (cls.kind == "data-dependent")
    assert cls.replaces_softmax == (cls.kind == "weights")
    assert not cls.rewrites_keys or cls.data_dependent  # PaTH's turn comes from its tokens


def test_check_positions_accepts_the_last_row_and_refuses_the_next() -> None:
    scheme = build_scheme(tiny_config("learned"))  # max_positions 64
    scheme.check_positions(torch.tensor([[63]]))
    scheme.check_positions(torch.zeros(1, 0, dtype=torch.long))  # nothing to check
    with pytest.raises(
        PositionOutOfRange, match=r"^position 64 .*'learned'.*max_positions=64 \(0\.\.63\)$"
    ):
        scheme.check_positions(torch.tensor([[64]]))
    build_scheme(tiny_config("rope")).check_positions(torch.tensor([[10**9]]))  # no table


def test_positions_table_is_one_batch_shared_row() -> None:
    assert torch.equal(positions_table(5), torch.arange(5).unsqueeze(0))
    assert positions_table(3, torch.device("meta")).device.type == "meta"


@pytest.mark.parametrize(("scheme", "buffer"), [("alibi", "slopes"), ("binary", "powers")])
def test_derived_buffers_are_not_stored_in_checkpoints(scheme: str, buffer: str) -> None:
    """A buffer computed from the config is rebuilt at load time, so it must stay out of the
    state dict (an old checkpoint would otherwise miss it); mds's coordinates are data, stored."""
    model = Transformer(tiny_config(scheme))
    assert f"positional.{buffer}" in dict(model.named_buffers())
    assert f"positional.{buffer}" not in model.state_dict()
    assert "positional.coordinates" in Transformer(tiny_config("mds")).state_dict()


@pytest.mark.parametrize(
    ("scheme", "positional"),
    [
        ("learned", {}),
        ("t5", {"num_buckets": 256, "max_distance": 1024}),
        ("lowrank", {"rank": 16}),
    ],
)
def test_trained_tables_start_at_gpt2_scale(scheme: str, positional: dict) -> None:
    """Learned rows, t5's bias table and the product A·Bᵀ of lowrank all start near N(0, 0.02²)."""
    torch.manual_seed(26)
    config = tiny_config(scheme, d_model=64, max_positions=512)
    built = build_scheme(config.replace(positional={"scheme": scheme, **positional}))
    table = {"learned": "table", "t5": "bias_table"}.get(scheme)
    values = getattr(built, table) if table else built.matrix()
    assert 0.017 < float(values.detach().std()) < 0.023


# ----------------------------------------------------------------------------------------- rope
# RoFormer (Su et al. 2021, eq. 34): R(m)x rotates each pair (x_2i, x_2i+1) COUNTERCLOCKWISE by
# m·θ_i, θ_i = base^(−2i/d): (x₁, x₂) → (x₁ cos mθ − x₂ sin mθ, x₁ sin mθ + x₂ cos mθ).
# ordinal uses GPT-NeoX's half-split layout, which pairs dimension i with i + d/2 instead: the
# same rotation after a fixed permutation of the dimensions (evens first, then odds), which the
# query and key projections absorb. With rotary_fraction < 1 only the first rotary_dim dimensions
# are rotated and θ_i uses d = rotary_dim (GPT-NeoX's rotary_ndims).


def rope_paper(x: list[float], m: float, base: float = 10000.0) -> list[float]:
    """The paper's R(m)·x for one vector ``x`` in its interleaved pair layout."""
    d = len(x)
    out: list[float] = []
    for i in range(d // 2):
        angle = m * base ** (-2 * i / d)
        first, second = x[2 * i], x[2 * i + 1]
        out += [
            first * math.cos(angle) - second * math.sin(angle),
            first * math.sin(angle) + second * math.cos(angle),
        ]
    return out


def half_split(v: torch.Tensor) -> torch.Tensor:
    """Interleaved layout → half-split: dims 0, 2, 4, … then 1, 3, 5, … (pair i → dims i, i+d/2)."""
    return torch.cat((v[..., 0::2], v[..., 1::2]), dim=-1)


def rope_expected(x: torch.Tensor, positions: list[float], base: float) -> torch.Tensor:
    """The paper's rotation of each row of ``x`` [T, d] (read as interleaved pairs) at its position,
    in ordinal's half-split layout → [T, d] float64."""
    rows = [rope_paper(row, m, base) for row, m in zip(x.double().tolist(), positions, strict=True)]
    return half_split(torch.tensor(rows, dtype=torch.float64))


def rope_scheme(**settings: object) -> rope_module.RotaryPositions:
    """The rope scheme of the tiny config (heads of 8 dims, context 48) with ``settings``."""
    return build_scheme(tiny_config("rope", positional={"scheme": "rope", **settings}))


def check_rope_against_the_paper(
    scheme: rope_module.RotaryPositions, positions: list[float], base: float, divisor: float = 1.0
) -> None:
    """Rotating random vectors with ``scheme`` gives the paper's rotation at position/divisor in
    the first rotary_dim dimensions, and leaves the others as they were."""
    head_dim, rotary = scheme.config.head_dim, scheme.rotary_dim
    generator = torch.Generator().manual_seed(27)
    x = torch.randn(len(positions), head_dim, generator=generator)  # rotated part interleaved
    ours = torch.cat((half_split(x[:, :rotary]), x[:, rotary:]), dim=-1)
    out = scheme.rotate(ours.view(1, 1, -1, head_dim), torch.tensor([positions]))[0, 0]
    expected = rope_expected(x[:, :rotary], [m / divisor for m in positions], base)
    torch.testing.assert_close(out[:, :rotary].double(), expected, atol=1e-5, rtol=0)
    assert torch.equal(out[:, rotary:], x[:, rotary:])


ROPE_POSITIONS = [0, 1, 2, 3, 7, 30, 47, 48, 100, 1234, 4095, 10_000]


def test_rope_turns_a_pair_counterclockwise_by_m_radians() -> None:
    """One pair (head_dim 2, θ = base⁰ = 1): at position m, (1, 0) becomes (cos m, sin m) and
    (0, 1) becomes (−sin m, cos m): the paper's +m·θ, not −m·θ."""
    scheme = build_scheme(tiny_config("rope", d_model=8, n_heads=4))
    positions = torch.tensor([0, 1, 2, 5])
    units = torch.eye(2).view(2, 1, 1, 2).expand(2, 1, 4, 2)  # e₁ in row 0, e₂ in row 1
    out = scheme.rotate(units, positions.expand(2, 4))
    m = positions.double()
    torch.testing.assert_close(out[0, 0].double(), torch.stack((m.cos(), m.sin()), -1))
    torch.testing.assert_close(out[1, 0].double(), torch.stack((-m.sin(), m.cos()), -1))


@pytest.mark.parametrize(
    ("settings", "rotary_dim"),
    [({}, 8), ({"base": 500.0}, 8), ({"rotary_fraction": 0.5}, 4), ({"rotary_fraction": 0.25}, 2)],
    ids=str,
)
def test_rope_rotation_is_the_papers(settings: dict, rotary_dim: int) -> None:
    scheme = rope_scheme(**settings)
    assert scheme.rotary_dim == rotary_dim
    check_rope_against_the_paper(scheme, ROPE_POSITIONS, settings.get("base", 10000.0))


@pytest.mark.parametrize("factor", [2.0, 4.0, 3.0])
def test_rope_linear_scaling_divides_positions_by_the_factor(factor: float) -> None:
    """Position interpolation (Chen et al. 2023): position m is rotated as m / s, a fraction."""
    scheme = rope_scheme(scaling="linear", scaling_factor=factor)
    check_rope_against_the_paper(scheme, ROPE_POSITIONS, 10000.0, divisor=factor)


@pytest.mark.parametrize(("factor", "fraction"), [(4.0, 1.0), (8.0, 1.0), (2.0, 0.5)])
def test_rope_ntk_scaling_multiplies_the_base_by_the_factor_to_d_over_d_minus_2(
    factor: float, fraction: float
) -> None:
    """NTK-aware scaling (bloc97, 2023): base' = base · s^(d/(d−2)), d = the rotated dims;
    positions are not divided."""
    scheme = rope_scheme(scaling="ntk", scaling_factor=factor, rotary_fraction=fraction)
    d = scheme.rotary_dim
    check_rope_against_the_paper(scheme, ROPE_POSITIONS, 10000.0 * factor ** (d / (d - 2)))


def test_rope_ntk_keeps_the_fastest_pair_and_interpolates_the_slowest_like_pi() -> None:
    """The property NTK's exponent is chosen for: pair 0 (θ = 1) is untouched, and the slowest
    pair turns exactly as under position interpolation by the same factor."""
    plain, linear = rope_scheme(), rope_scheme(scaling="linear", scaling_factor=4.0)
    ntk = rope_scheme(scaling="ntk", scaling_factor=4.0)
    positions = torch.arange(0, 3000, 7).unsqueeze(0)
    slowest = plain.rotary_dim // 2 - 1
    for table, plain_table, linear_table in zip(
        ntk.rotation(positions), plain.rotation(positions), linear.rotation(positions), strict=True
    ):
        torch.testing.assert_close(table[..., 0], plain_table[..., 0], atol=1e-6, rtol=0)
        torch.testing.assert_close(
            table[..., slowest], linear_table[..., slowest], atol=1e-5, rtol=0
        )
        assert (table[..., slowest] - plain_table[..., slowest]).abs().max() > 0.1


def test_rope_ntk_leaves_a_single_pair_alone() -> None:
    """With one rotated pair there is only θ = 1, the frequency NTK keeps: nothing changes."""
    ntk = rope_scheme(scaling="ntk", scaling_factor=4.0, rotary_fraction=0.25)
    assert ntk.rotary_dim == 2 and ntk.base == 10000.0
    check_rope_against_the_paper(ntk, ROPE_POSITIONS, 10000.0)


def test_rope_table_is_reused_and_grows_geometrically(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding one position at a time to 16 × the context builds the cos/sin table a handful of
    times (the context, then doubling), not once per step, and every lookup stays exact."""
    built: list[int] = []
    original = rope_module.rope_angles

    def counting_rope_angles(positions: torch.Tensor, rotary_dim: int, base: float) -> tuple:
        built.append(len(positions))
        return original(positions, rotary_dim, base)

    monkeypatch.setattr(rope_module, "rope_angles", counting_rope_angles)
    scheme = rope_scheme()  # context_length 48
    steps = 16 * scheme.config.context_length
    rotations = []
    for p in range(steps):
        rotations.append(scheme.rotation(torch.tensor([[p]])))
        assert len(built) <= 5, f"rebuilt {built} by position {p}"  # 48, 96, 192, 384, 768 rows
    cos, sin = original(torch.arange(steps), scheme.rotary_dim, scheme.base)
    assert torch.equal(torch.cat([c[0, 0] for c, _ in rotations]), cos)
    assert torch.equal(torch.cat([s[0, 0] for _, s in rotations]), sin)


def test_rope_fraction_one_is_rope_exactly() -> None:
    rope = random_model("rope", seed=40)
    full_fraction = Transformer(tiny_config("rope", positional={"scheme": "rope", "fraction": 1.0}))
    full_fraction.load_state_dict(rope.state_dict())
    positions = torch.arange(300).unsqueeze(0)
    for mine, theirs in zip(
        full_fraction.positional.rotation(positions),
        rope.positional.rotation(positions),
        strict=True,
    ):
        assert torch.equal(mine, theirs)
    tokens = random_tokens(2, 40, seed=41)
    with torch.no_grad():
        assert torch.equal(full_fraction.eval()(tokens), rope(tokens))


@pytest.mark.parametrize(
    ("head_dim", "fraction", "kept"), [(8, 0.75, 3), (32, 0.75, 12), (32, 0.5, 8)]
)
def test_rope_fraction_keeps_the_fastest_frequencies_and_stills_the_rest(
    head_dim: int, fraction: float, kept: int
) -> None:
    """p-RoPE: the kept pairs turn at rope's own frequencies base^(−2i/d) (not re-spaced over
    fewer dims, as rotary_fraction does); the dropped pairs, the slowest, do not turn at all."""
    config = tiny_config("rope", d_model=4 * head_dim)
    rope = build_scheme(config)
    partial = build_scheme(config.replace(positional={"scheme": "rope", "fraction": fraction}))
    positions = torch.tensor([[0, 1, 5, 47, 48, 1000]])
    half = head_dim // 2
    kept_columns = (torch.arange(head_dim) % half) < kept
    (cos, sin), (rope_cos, rope_sin) = partial.rotation(positions), rope.rotation(positions)
    assert torch.equal(cos[..., kept_columns], rope_cos[..., kept_columns])
    assert torch.equal(sin[..., kept_columns], rope_sin[..., kept_columns])
    assert (cos[..., ~kept_columns] == 1).all() and (sin[..., ~kept_columns] == 0).all()
    x = torch.randn(1, 4, 6, head_dim, generator=torch.Generator().manual_seed(42))
    assert torch.equal(partial.rotate(x, positions)[..., ~kept_columns], x[..., ~kept_columns])


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5, 0.1])
def test_rope_fraction_out_of_range_is_refused(fraction: float) -> None:
    """Outside (0, 1], or so small that no pair of the 4 a head of 8 dims has is kept."""
    with pytest.raises(ConfigError, match=r"positional\.fraction"):
        Transformer(tiny_config("rope", positional={"scheme": "rope", "fraction": fraction}))


def test_rope_rotation_of_no_positions_is_empty() -> None:
    cos, sin = rope_scheme().rotation(torch.zeros(2, 0, dtype=torch.long))
    assert cos.shape == sin.shape == (2, 1, 0, 8)


def test_rope_tables_are_float32_and_rotation_keeps_the_input_dtype() -> None:
    scheme = rope_scheme()
    positions = torch.tensor([[0, 5, 9, 300]])
    cos, sin = scheme.rotation(positions)
    assert cos.dtype == sin.dtype == torch.float32
    x = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(28))
    for dtype, tolerance in ((torch.bfloat16, 5e-2), (torch.float64, 1e-6)):
        out = scheme.rotate(x.to(dtype), positions)
        assert out.dtype == dtype
        torch.testing.assert_close(
            out.float(), scheme.rotate(x.to(dtype).float(), positions), atol=tolerance, rtol=0
        )


@pytest.mark.parametrize("base", [None, 500.0])
def test_apply_rope_rotates_batched_positions(base: float | None) -> None:
    """Rotating at rope's angles (``rope_angles``, as the scheme rotates): every dimension,
    positions broadcast per row, and base 10000 unless told otherwise."""
    generator = torch.Generator().manual_seed(29)
    x = torch.randn(2, 3, 4, 8, generator=generator)  # [B, H, T, d], interleaved
    positions = torch.tensor([[0, 1, 2, 3], [10, 200, 3000, 40000]])
    extra = {} if base is None else {"base": base}
    out = apply_rotation(
        half_split(x), *rope_angles(positions.unsqueeze(1), x.shape[-1], **extra)
    )  # positions [B, 1, T]
    for b in range(2):
        for h in range(3):
            expected = rope_expected(x[b, h], positions[b].tolist(), base or 10000.0)
            torch.testing.assert_close(out[b, h].double(), expected, atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device (CUDA)")
def test_rope_tables_follow_the_positions_device() -> None:
    scheme = rope_scheme()
    cpu = scheme.rotation(torch.tensor([[1, 2]]))
    cuda = scheme.rotation(torch.tensor([[1, 2]], device="cuda"))
    assert [table.device.type for table in cuda] == ["cuda", "cuda"]
    for on_cpu, on_cuda in zip(cpu, cuda, strict=True):
        torch.testing.assert_close(on_cuda.cpu(), on_cpu)


def test_rope_angles_default_to_base_10000() -> None:
    cos, sin = rope_angles(torch.tensor([3.0]), 4)  # θ = 1 and 10000^(-1/2) = 1/100
    angles = torch.tensor([[3.0, 0.03, 3.0, 0.03]], dtype=torch.float64)
    torch.testing.assert_close(cos.double(), angles.cos())
    torch.testing.assert_close(sin.double(), angles.sin())


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"rotary_fraction": 0.0}, "rotary_fraction must be in"),
        ({"rotary_fraction": 1.5}, "rotary_fraction must be in"),
        ({"scaling": "longrope"}, "scaling must be one of"),
        ({"scaling_factor": 0.5}, "scaling_factor must be ≥ 1"),
        ({"original_context": 0}, "original_context must be ≥ 1"),
        ({"beta_slow": 0.0}, "beta_slow"),
        ({"beta_slow": 2.0, "beta_fast": 2.0}, "beta_slow"),
    ],
)
def test_rope_parameters_out_of_range_are_refused(settings: dict, message: str) -> None:
    # The edges are valid: a fraction of 1, a factor of 1, a context of one token, and any
    # 0 < beta_slow < beta_fast however close.
    RopeParams(rotary_fraction=1.0, scaling="ntk", scaling_factor=1.0, original_context=1)
    RopeParams(beta_slow=1e-9, beta_fast=2e-9)
    with pytest.raises(ValueError, match=message):
        RopeParams(**settings)


# ----------------------------------------------------------------------------------- sinusoidal
# Vaswani et al. (2017), section 3.5: PE(p, 2i) = sin(p / base^(2i/d)), PE(p, 2i+1) = cos(same).


def sinusoidal_formula(p: int, d: int, base: float = 10000.0) -> list[float]:
    return [
        (math.sin if k % 2 == 0 else math.cos)(p / base ** (2 * (k // 2) / d)) for k in range(d)
    ]


SINUSOIDAL_POSITIONS = [0, 1, 2, 5, 17, 100, 999, 4096, 9999, 20_000]


def test_sinusoidal_encoding_is_the_formula_far_into_the_positions() -> None:
    """Exact to float32 rounding at position 20,000 (float64 angles, as the module promises)."""
    expected = torch.tensor([sinusoidal_formula(p, 64) for p in SINUSOIDAL_POSITIONS])
    encoding = sinusoidal_encoding(torch.tensor(SINUSOIDAL_POSITIONS), 64)  # default base
    assert encoding.shape == (len(SINUSOIDAL_POSITIONS), 64) and encoding.dtype == torch.float32
    torch.testing.assert_close(encoding.double(), expected.double(), atol=1e-6, rtol=0)
    table = sinusoidal_table(50, 16)
    assert torch.equal(table, sinusoidal_encoding(torch.arange(50), 16))
    torch.testing.assert_close(
        table.double(), torch.tensor([sinusoidal_formula(p, 16) for p in range(50)]).double()
    )
    other_base = torch.tensor([sinusoidal_formula(p, 16, 500.0) for p in range(50)])
    torch.testing.assert_close(sinusoidal_table(50, 16, 500.0).double(), other_base.double())


def test_sinusoidal_scheme_adds_the_formula_times_its_scale() -> None:
    config = tiny_config(
        "sinusoidal", positional={"scheme": "sinusoidal", "base": 500.0, "scale": 2.0}
    )
    positions = torch.tensor([SINUSOIDAL_POSITIONS, SINUSOIDAL_POSITIONS[::-1]])
    vectors = build_scheme(config).embedding(positions)
    assert vectors.shape == (2, len(SINUSOIDAL_POSITIONS), 32)
    expected = torch.tensor(
        [[sinusoidal_formula(p, 32, 500.0) for p in row] for row in positions.tolist()]
    )
    torch.testing.assert_close(vectors.double(), 2 * expected.double(), atol=2e-6, rtol=0)


def test_position_angles_are_the_shared_clock_hands() -> None:
    """p · base^(−2i/d) per pair, float64, on the positions' device; an odd dimension is refused."""
    angles = position_angles(torch.tensor([2, 30]), 4)
    assert angles.dtype == torch.float64
    assert torch.equal(angles, torch.tensor([[2.0, 0.02], [30.0, 0.3]], dtype=torch.float64))
    assert position_angles(torch.arange(3, device="meta"), 8).device.type == "meta"
    with pytest.raises(ValueError, match="even number of dimensions, got 7"):
        position_angles(torch.arange(3), 7)


# ---------------------------------------------------------------------------------------- alibi


def alibi_paper_slopes(n: int) -> list[float]:
    """``get_slopes`` from the ALiBi authors' code (Press et al., attention_with_linear_biases),
    transcribed: a geometric sequence starting at and multiplied by 2^(−8/n) for a power of two n;
    otherwise those of the closest smaller power of two, then every other slope of twice it."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + alibi_paper_slopes(2 * closest)[0::2][: n - closest]


def test_alibi_slopes_are_the_papers_for_every_head_count() -> None:
    for heads in range(1, 41):
        expected = torch.tensor(alibi_paper_slopes(heads))
        torch.testing.assert_close(alibi_slopes(heads), expected, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="n_heads must be ≥ 1, got 0"):
        alibi_slopes(0)


# ------------------------------------------------------------------------------------------- t5


def t5_bucket_reference(n: int, num_buckets: int, max_distance: int) -> int:
    """Mesh TensorFlow's ``_relative_position_bucket`` (T5, Raffel et al. 2020) for a decoder
    (bidirectional=False), transcribed. It takes relative_position = key − query and sets
    n = −relative_position (= query − key, our distance), then n = max(n, 0)."""
    n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:  # is_small: one bucket per distance
        return n
    val_if_large = max_exact + int(
        math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    )
    return min(val_if_large, num_buckets - 1)


@pytest.mark.parametrize(
    ("num_buckets", "max_distance"),
    [(32, 128), (8, 24), (10, 100), (64, 1000), (7, 50), (12, 13), (2, 8), (3, 3), (3, 4)],
)
def test_t5_buckets_are_mesh_tensorflows(num_buckets: int, max_distance: int) -> None:
    distances = torch.arange(-5, 4 * max_distance)
    expected = [t5_bucket_reference(n, num_buckets, max_distance) for n in distances.tolist()]
    assert relative_position_bucket(distances, num_buckets, max_distance).tolist() == expected


def test_t5_default_buckets_at_known_distances() -> None:
    """T5's defaults (32 buckets, max_distance 128), worked by hand: distances 0–15 exact, then
    16 + ⌊16 · ln(n/16) / ln 8⌋, capped at 31."""
    distances = [0, 1, 15, 16, 17, 20, 24, 32, 48, 64, 100, 127, 128, 500]
    buckets = [0, 1, 15, 16, 16, 17, 19, 21, 24, 26, 30, 31, 31, 31]
    assert relative_position_bucket(torch.tensor(distances)).tolist() == buckets
    every = torch.arange(600)
    expected = [t5_bucket_reference(n, 32, 128) for n in every.tolist()]
    assert relative_position_bucket(every).tolist() == expected


@pytest.mark.parametrize(
    ("num_buckets", "max_distance", "message"),
    [
        (2, 2, None),
        (1, 8, r"num_buckets must be ≥ 2, got 1"),
        (8, 5, None),
        (8, 4, r"max_distance \(4\) must exceed num_buckets/2 \(4\)"),
        (9, 4, r"max_distance \(4\) must exceed num_buckets/2 \(4\)"),
    ],
)
def test_t5_parameters_at_their_limits(num_buckets: int, max_distance: int, message: str) -> None:
    if message is None:
        T5Params(num_buckets=num_buckets, max_distance=max_distance)
    else:
        with pytest.raises(ValueError, match=message):
            T5Params(num_buckets=num_buckets, max_distance=max_distance)


# ---------------------------------------------------------------------- integer, binary, tables


def test_integer_adds_position_times_scale_to_every_dimension() -> None:
    scheme = build_scheme(tiny_config("integer", positional={"scheme": "integer", "scale": 0.5}))
    vectors = scheme.embedding(torch.tensor([[0, 3, 10]]))
    assert torch.equal(vectors, torch.tensor([0.0, 1.5, 5.0]).view(1, 3, 1).expand(1, 3, 32))


@pytest.mark.parametrize("scheme", ["integer", "binary"])
def test_an_integer_scale_still_gives_float_vectors(scheme: str) -> None:
    """config.json may well say "scale": 2; positions are long, the vectors must not be."""
    settings = {"scheme": scheme, "scale": 2, **({"bits": 8} if scheme == "binary" else {})}
    vectors = build_scheme(tiny_config(scheme, positional=settings)).embedding(torch.tensor([[3]]))
    assert vectors.dtype == torch.float32
    assert vectors[0, 0, 0] == (6.0 if scheme == "integer" else 2.0)


@pytest.mark.parametrize(("bits", "valid"), [(0, False), (1, True), (62, True), (63, False)])
def test_binary_bits_are_1_to_62(bits: int, valid: bool) -> None:
    if valid:
        BinaryParams(bits=bits)
    else:
        with pytest.raises(ValueError, match=rf"bits must be in 1\.\.62, got {bits}"):
            BinaryParams(bits=bits)


def test_binary_may_use_every_dimension_but_no_more() -> None:
    scheme = build_scheme(tiny_config("binary", positional={"scheme": "binary", "bits": 32}))
    vectors = scheme.embedding(torch.tensor([[5, 2**32 - 1]]))
    assert vectors[0, 0, :4].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert torch.equal(vectors[0, 1], torch.ones(32))
    with pytest.raises(ConfigError, match=r"bits \(33\) must be ≤ d_model \(32\)"):
        build_scheme(tiny_config("binary", positional={"scheme": "binary", "bits": 33}))


@pytest.mark.parametrize("params", [LowRankParams, MdsParams])
def test_rank_is_at_least_one(params: type) -> None:
    params(rank=1)
    with pytest.raises(ValueError, match="rank must be ≥ 1, got 0"):
        params(rank=0)


def test_table_schemes_look_up_their_rows() -> None:
    positions = torch.tensor([[0, 7, 63], [1, 1, 2]])
    learned = build_scheme(tiny_config("learned"))
    assert torch.equal(learned.embedding(positions), learned.table[positions])
    lowrank = build_scheme(tiny_config("lowrank"))
    product = lowrank.position_factor @ lowrank.model_factor.T
    assert torch.equal(lowrank.matrix(), product)
    torch.testing.assert_close(lowrank.embedding(positions), product[positions])


def test_mds_installs_coordinates_zero_padded_and_scaled() -> None:
    scheme = build_scheme(tiny_config("mds", positional={"scheme": "mds", "rank": 8, "scale": 2.0}))
    generator = torch.Generator().manual_seed(30)
    scheme.set_coordinates(torch.randn(64, 8, generator=generator))  # the full rank fits
    coordinates = torch.randn(64, 5, generator=generator, dtype=torch.float64)
    scheme.set_coordinates(coordinates)  # fewer columns: the rest become zero
    positions = torch.tensor([[0, 7, 63]])
    expected = torch.zeros(1, 3, 32)
    expected[0, :, :5] = 2.0 * coordinates[[0, 7, 63]].float()
    assert torch.equal(scheme.embedding(positions), expected)
    for shape in ((63, 5), (64, 9)):
        message = rf"shape {re.escape(str(shape))} do not fit a table of \[64, ≤8\]"
        with pytest.raises(ValueError, match=message):
            scheme.set_coordinates(torch.zeros(shape))
    build_scheme(tiny_config("mds", positional={"scheme": "mds", "rank": 32}))  # rank = d_model


# ---- rope's context extension: dynamic NTK and YaRN -------------------------------------------


def hf_yarn_frequencies(dim: int, base: float, factor: float, original: int) -> list[float]:
    """A direct transcription of Hugging Face's ``_compute_yarn_parameters`` (beta_fast 32,
    beta_slow 1), in plain Python: the reference our tensor code is held to."""

    def find_correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(find_correction_dim(32)), 0)
    high = min(math.ceil(find_correction_dim(1)), dim - 1)
    if low == high:
        high += 0.001
    frequencies = []
    for i in range(dim // 2):
        pos_freq = base ** (2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extrapolation_factor = 1 - ramp
        interpolation, extrapolation = 1 / (factor * pos_freq), 1 / pos_freq
        frequencies.append(
            interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
        )
    return frequencies


@pytest.mark.parametrize(
    ("dim", "base", "factor", "original"),
    [(8, 10000.0, 4.0, 48), (32, 10000.0, 4.0, 128), (64, 500000.0, 8.0, 4096), (16, 10.0, 2.0, 7)],
)
def test_yarn_frequencies_are_hugging_faces(
    dim: int, base: float, factor: float, original: int
) -> None:
    ours = rope_module.yarn_inverse_frequencies(dim, base, factor, original, 32.0, 1.0)
    assert ours.tolist() == pytest.approx(
        hf_yarn_frequencies(dim, base, factor, original), rel=1e-12
    )
    # the fastest pairs keep their frequency, the slowest are interpolated by the factor
    plain = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    assert float(ours[0]) == float(plain[0]) or float(ours[0]) > float(plain[0]) / factor
    assert float(ours[-1]) == pytest.approx(float(plain[-1]) / factor, rel=1e-12)


def test_yarn_tables_are_the_ramped_angles_times_its_attention_temperature() -> None:
    config = tiny_config("rope", d_model=64, n_heads=2, positional={"scheme": "rope"})
    settings = {"scheme": "rope", "scaling": "yarn", "scaling_factor": 4.0}
    yarn = build_scheme(config.replace(positional=settings))
    positions = torch.arange(0, 400, 3).unsqueeze(0)
    cos, sin = yarn.rotation(positions)
    frequencies = torch.tensor(hf_yarn_frequencies(32, 10000.0, 4.0, config.context_length))
    angles = positions[0].double().unsqueeze(-1) * frequencies
    temperature = 0.1 * math.log(4.0) + 1
    expected = torch.cat((angles, angles), dim=-1)
    # float32 tables: half a unit in the last place of values up to the temperature (~1.14)
    close = {"atol": 2e-6, "rtol": 0}
    torch.testing.assert_close(cos[0, 0].double(), expected.cos() * temperature, **close)
    torch.testing.assert_close(sin[0, 0].double(), expected.sin() * temperature, **close)
    # still relative: q_m · k_n depends on m − n only, now scaled by the temperature squared
    q, k = torch.randn(2, 1, 1, 1, 32, generator=torch.Generator().manual_seed(3))
    score = lambda m, n: (  # noqa: E731
        yarn.rotate(q, torch.tensor([[m]])) * yarn.rotate(k, torch.tensor([[n]]))
    ).sum()
    assert score(205, 200).item() == pytest.approx(score(15, 10).item(), rel=1e-4)
    plain = build_scheme(config)
    unscaled = (plain.rotate(q, torch.tensor([[0]])) * plain.rotate(k, torch.tensor([[0]]))).sum()
    assert score(0, 0).item() == pytest.approx(unscaled.item() * temperature**2, rel=1e-5)


def test_dynamic_ntk_keeps_the_trained_base_within_the_context_and_grows_past_it() -> None:
    config = tiny_config("rope", d_model=64, n_heads=2, positional={"scheme": "rope"})
    length, factor, d = config.context_length, 4.0, 32
    dynamic = build_scheme(
        config.replace(
            positional={"scheme": "rope", "scaling": "dynamic", "scaling_factor": factor}
        )
    )
    plain = build_scheme(config)
    within = torch.arange(length).unsqueeze(0)
    for ours, reference in zip(dynamic.rotation(within), plain.rotation(within), strict=True):
        assert torch.equal(ours, reference)
    for current in (length + 1, 3 * length, 10 * length):
        positions = torch.arange(current).unsqueeze(0)
        base = 10000.0 * ((factor * current / length) - (factor - 1)) ** (d / (d - 2))
        cos, _ = dynamic.rotation(positions)
        angles = positions[0].double().unsqueeze(-1) * base ** (
            -torch.arange(0, d, 2, dtype=torch.float64) / d
        )
        expected = torch.cat((angles, angles), dim=-1).cos()
        torch.testing.assert_close(cos[0, 0].double(), expected, atol=1e-6, rtol=0)
    # back within the context (a new, short request): the trained base again
    for ours, reference in zip(dynamic.rotation(within), plain.rotation(within), strict=True):
        assert torch.equal(ours, reference)


@pytest.mark.parametrize("scaling", [None, "linear", "ntk", "dynamic", "yarn"])
def test_decoding_a_position_a_step_keeps_the_rotation_table_within_twice_the_length(
    scaling: str | None,
) -> None:
    """A decode step asks for one more position each time. Dynamic's base moves at every step
    past L, so its table is rebuilt at every step: at its own length, not doubled (doubling at
    each rebuild made 2^k·L rows at the k-th step past L, and the engine hung)."""
    config = tiny_config("rope", positional={"scheme": "rope"})
    settings = {"scheme": "rope", "scaling": scaling, "scaling_factor": 2.0}
    scheme = build_scheme(config.replace(positional=settings if scaling else {"scheme": "rope"}))
    longest = 4 * config.context_length
    for position in range(longest):
        cos, _ = scheme.rotation(torch.tensor([[position]]))
        assert cos.shape[-2] == 1
        assert scheme._table is not None
        rows = scheme._table[0].shape[0]
        assert rows <= 2 * longest, f"{rows} rows at position {position}"


def test_yarn_ramp_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="beta_slow"):
        RopeParams(scaling="yarn", scaling_factor=2.0, beta_fast=1.0, beta_slow=2.0)
    with pytest.raises(ValueError, match="original_context"):
        RopeParams(scaling="yarn", scaling_factor=2.0, original_context=0)


def test_the_registry_names_each_class_as_it_names_itself_and_imports_it_on_use() -> None:
    """``SCHEMES`` lists the names without importing a scheme (``ordinal --help`` reads them);
    each entry's class is that scheme, and membership never imports."""
    assert [SCHEMES[name].name for name in SCHEMES] == list(SCHEMES)
    assert "xpos" not in SCHEMES and "rope" in SCHEMES
    with pytest.raises(KeyError):
        SCHEMES["xpos"]
