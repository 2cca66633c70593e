"""FoX, CoPE and FIRE compute their papers' formulas, FIRE holds ALiBi and T5 as special cases,
and the cached forward of each equals its full forward on ragged batches past the trained length.

The references are computed here from the defining formulas, one query and key at a time in
float64: FoX's D_ij = Σ_{l=j+1..i} log σ(w·x_l + b) (Lin et al. 2025), CoPE's
p_ij = Σ_{t=j..i} σ(q_i·k_t/√d) with an interpolated embedding (Golovneva et al. 2024), FIRE's
f_θ(ψ(i − j)/ψ(max(L, i))) with ψ(x) = log(cx + 1) (Li et al. 2024).
"""

from __future__ import annotations

import math

import pytest
import torch

from model.cache import KVCache
from model.positional import build_scheme
from model.positional.alibi import alibi_slopes
from model.positional.cope import ContextualPositions
from model.positional.fire import FirePositions
from model.positional.fox import ForgettingPositions
from model.positional.t5 import relative_position_bucket
from model.transformer import Transformer
from tests.model.conftest import random_model, random_tokens, randomise, tiny_config
from tests.model.test_transformer import assert_rows_match, feed_ragged

HEADS = 4  # the tiny config's


def causal(length: int) -> torch.Tensor:
    """[1, 1, T, T] bool: query i sees keys 0..i."""
    return torch.ones(length, length, dtype=torch.bool).tril().view(1, 1, length, length)


# ------------------------------------------------------------------------------------------ FoX


def test_fox_bias_is_the_sum_of_log_forget_gates_between_key_and_query() -> None:
    scheme = random_model("fox", seed=1).positional
    assert isinstance(scheme, ForgettingPositions)
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 9, 32, generator=generator)
    layer = 1
    with torch.no_grad():
        state = scheme.key_state(layer, hidden)  # [B, H, T]
        got = scheme.layer_bias(layer, hidden, hidden, state, causal(9))
    assert got is not None and got.gates is not None
    weight, bias = (p[layer].detach().double() for p in (scheme.gate_weight, scheme.gate_bias))
    gates = torch.sigmoid(hidden.double() @ weight.T + bias)  # [B, T, H]
    torch.testing.assert_close(got.gates, gates.transpose(1, 2).float())
    for row in range(2):
        for head in range(HEADS):
            for i in range(9):
                for j in range(i + 1):
                    expected = sum(math.log(gates[row, t, head]) for t in range(j + 1, i + 1))
                    assert float(got.bias[row, head, i, j]) == pytest.approx(expected, abs=1e-5)
    assert got.bias.std() > 0.1  # the gates are far from 1: positions matter


def test_fox_with_open_gates_is_nope() -> None:
    """σ(40) = 1 to float precision: nothing is forgotten, so FoX is the same model as none."""
    fox = random_model("fox", seed=3)
    with torch.no_grad():
        fox.positional.gate_weight.zero_()
        fox.positional.gate_bias.fill_(40.0)
    nope = Transformer(tiny_config("none")).eval()
    nope.load_state_dict(fox.state_dict(), strict=False)
    tokens = random_tokens(2, 20, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(fox(tokens), nope(tokens), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------- CoPE


def test_cope_positions_count_the_gated_keys_and_interpolate_the_table() -> None:
    scheme = random_model("cope", seed=5).positional  # 16 rows
    assert isinstance(scheme, ContextualPositions)
    generator = torch.Generator().manual_seed(6)
    queries, keys = torch.randn(2, 1, HEADS, 30, 8, generator=generator).unbind(0)
    with torch.no_grad():
        got = scheme.layer_bias(0, queries, keys, None, causal(30))
    assert got is not None and got.positions is not None
    table = scheme.table[0].detach().double()  # [16, 8]
    q, k = queries[0].double(), keys[0].double()
    for head in range(HEADS):
        for i in range(30):
            for j in range(i + 1):
                gates = [
                    torch.sigmoid(q[head, i] @ k[head, t] / math.sqrt(8)) for t in range(j, i + 1)
                ]
                position = float(sum(gates))
                assert float(got.positions[0, head, i, j]) == pytest.approx(position, rel=1e-5)
                clamped = min(position, 15.0)
                below, weight = math.floor(clamped), clamped - math.floor(clamped)
                embedding = (1 - weight) * table[below] + weight * table[math.ceil(clamped)]
                expected = float(q[head, i] @ embedding)
                assert float(got.bias[0, head, i, j]) == pytest.approx(expected, abs=1e-4)
    assert float(got.positions.max()) > 15  # some positions run past the table: clamped


def test_cope_starts_at_zero_so_an_untrained_cope_is_nope() -> None:
    torch.manual_seed(7)
    cope = Transformer(tiny_config("cope"))
    assert not cope.positional.table.any()  # the paper's initialisation
    randomise(cope, seed=8)
    with torch.no_grad():
        cope.positional.table.zero_()
    nope = Transformer(tiny_config("none")).eval()
    nope.load_state_dict(cope.state_dict(), strict=False)
    tokens = random_tokens(2, 20, seed=9)
    with torch.no_grad():
        torch.testing.assert_close(cope.eval()(tokens), nope(tokens), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------- FIRE


def raw_distance_fire(hidden: int) -> FirePositions:
    """A FIRE whose MLP reads the raw distance i − j (no log, no normalisation)."""
    positional = {"scheme": "fire", "hidden": hidden, "log_transform": False, "normalise": False}
    scheme = build_scheme(tiny_config("fire", positional=positional))
    assert isinstance(scheme, FirePositions)
    return scheme


def test_fire_reproduces_alibis_slopes() -> None:
    """f(d) = −m_h·relu(d): one hidden unit of weight 1, output weights −m_h."""
    fire = raw_distance_fire(hidden=1)
    alibi = build_scheme(tiny_config("alibi"))
    with torch.no_grad():
        fire.mlp_in.weight.fill_(1.0)
        fire.mlp_in.bias.zero_()
        fire.mlp_out.weight.copy_(-alibi_slopes(HEADS).unsqueeze(1))
        fire.mlp_out.bias.zero_()
        queries = torch.tensor([[0, 3, 47, 48, 300, 1999]])
        keys = torch.arange(2000)
        seen = (keys <= queries.unsqueeze(-1)).unsqueeze(1).expand(-1, HEADS, -1, -1)
        got, expected = fire.attention_bias(queries, keys), alibi.attention_bias(queries, keys)
    assert torch.equal(got[seen], expected[seen])  # bit for bit, past any trained length


@pytest.mark.parametrize(("num_buckets", "max_distance"), [(8, 24), (32, 128), (10, 100)])
def test_fire_reproduces_t5s_buckets(num_buckets: int, max_distance: int) -> None:
    """T5's bias is a step function of the distance: at each distance d where the bucket
    changes, relu(x − d + 1) − relu(x − d) steps from 0 to 1 between the integers d − 1 and d,
    so two hidden units per step (output weights ± the change of the table) and the first
    bucket's value as the output bias give the table's value at every integer distance.
    The MLP runs in float64 here: the two units of a step grow with the distance and cancel, so
    float32 would round ~1e-4 off far keys (precision, not the function)."""
    positional = {"scheme": "t5", "num_buckets": num_buckets, "max_distance": max_distance}
    t5 = randomise(Transformer(tiny_config("t5", positional=positional)), seed=10).positional
    table = t5.bias_table.detach()  # [buckets, heads]
    buckets = relative_position_bucket(torch.arange(max_distance + 1), num_buckets, max_distance)
    steps = [d for d in range(1, max_distance + 1) if buckets[d] != buckets[d - 1]]
    fire = raw_distance_fire(hidden=2 * len(steps)).double()
    table = table.double()
    with torch.no_grad():
        fire.mlp_in.weight.fill_(1.0)
        fire.mlp_in.bias.copy_(torch.tensor([[1.0 - d, -d] for d in steps]).flatten())
        change = torch.stack([table[buckets[d]] - table[buckets[d - 1]] for d in steps])
        fire.mlp_out.weight.copy_(torch.stack((change, -change), dim=1).flatten(0, 1).T)
        fire.mlp_out.bias.copy_(table[0])
        queries = torch.tensor([[0, 5, 40, 127, 128, 1000]])
        keys = torch.arange(1001)
        got, expected = fire.attention_bias(queries, keys), t5.attention_bias(queries, keys)
    torch.testing.assert_close(got.float(), expected, atol=1e-6, rtol=0)  # later keys: both 0
    assert expected.std() > 0.1


def test_fire_bias_is_the_mlp_of_the_log_distance_over_the_log_query_position() -> None:
    scheme = random_model("fire", seed=11).positional  # L = |multiplier| × 100
    assert isinstance(scheme, FirePositions)
    c = abs(scheme.c.item())
    threshold = abs(scheme.threshold_scale.item()) * 100.0
    queries = torch.tensor([[0, 1, 7, int(threshold) + 5, 400]])
    keys = torch.arange(401)
    with torch.no_grad():
        got = scheme.attention_bias(queries, keys)  # [1, H, 5, 401]
    w_in, b_in = scheme.mlp_in.weight.detach().double()[:, 0], scheme.mlp_in.bias.detach().double()
    w_out, b_out = scheme.mlp_out.weight.detach().double(), scheme.mlp_out.bias.detach().double()

    def psi(x: float) -> float:
        return math.log(c * x + 1)

    for row, i in enumerate(queries[0].tolist()):
        for j in range(0, i + 1, 7):
            u = psi(i - j) / (psi(max(threshold, i)) + 1e-6)
            expected = w_out @ torch.relu(w_in * u + b_in) + b_out  # [H]
            torch.testing.assert_close(got[0, :, row, j].double(), expected, atol=1e-5, rtol=0)


def test_fire_parameters_out_of_range_are_refused() -> None:
    for settings, named in [
        ({"hidden": 0}, "hidden"),
        ({"c": 0.0}, "c"),
        ({"threshold": -1.0}, "threshold"),
    ]:
        with pytest.raises(ValueError, match=f"positional.{named}"):
            tiny_config("fire", positional={"scheme": "fire", **settings})


# ------------------------------------------------------------------- the KV cache, past L


@pytest.mark.parametrize("scheme", ["fox", "cope", "fire"])
def test_cached_forward_equals_the_full_forward_on_ragged_batches_past_the_trained_length(
    scheme: str,
) -> None:
    """A ragged prefill, single steps and a ragged chunk run to 64 tokens, past the context
    (48), FIRE's threshold (12 at default settings) and CoPE's table (16 rows)."""
    positional = {"scheme": scheme, **({"threshold": 12.0} if scheme == "fire" else {})}
    model = random_model(scheme, seed=12, positional=positional)
    tokens = random_tokens(4, 64, seed=13)
    cache = KVCache(model.config, 4, 64, reserve=(2, 8))  # grows as it goes
    cache.reserve(4, 0)
    with torch.no_grad():
        full = model(tokens)
        for counts in ([13, 40, 1, 27], [1, 1, 1, 1], [20, 9, 30, 2], [1, 1, 1, 1]):
            starts, counts_tensor = cache.lengths.clone(), torch.tensor(counts)
            logits = feed_ragged(model, cache, tokens, counts_tensor)
            assert_rows_match(logits, full, starts, counts_tensor)
    assert cache.lengths.tolist() == [35, 51, 33, 31]
