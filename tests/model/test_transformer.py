"""The cached paths of Transformer.forward compute exactly what one full forward pass computes.

For every positional scheme (with randomised parameters, so that a wrong position shows), the
logits of incremental decoding equal those of a full forward over the same tokens: ragged
prefill, one-token steps with rows at different positions, ragged and uniform multi-token chunks,
writes into a slice of a bigger cache, and rows moved inside the cache.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.cache import CacheFull, KVCache
from model.positional import SCHEMES
from model.transformer import AttentionMask, AttentionRecorder, Intervention, Transformer, attend
from tests.model.conftest import ALL_SCHEMES, random_model, random_tokens

ATOL = 1e-4
SEQUENCE_LENGTH = 24


def assert_rows_match(
    logits: torch.Tensor, full: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor
) -> None:
    """Row b of ``logits`` [B, T, V] holds positions starts[b] .. starts[b]+counts[b]-1 of
    ``full`` [B, L, V]; compare those, ignore the padding after them."""
    for row, (start, count) in enumerate(zip(starts.tolist(), counts.tolist(), strict=True)):
        expected = full[row, start : start + count]
        torch.testing.assert_close(logits[row, :count], expected, atol=ATOL, rtol=0)


def feed_ragged(
    model: Transformer,
    cache: KVCache,
    tokens: torch.Tensor,
    counts: torch.Tensor,
    rows: slice | None = None,
    pad_token: int = 0,
) -> torch.Tensor:
    """Feed row b its next counts[b] tokens of ``tokens`` [B, L] as one right-padded chunk."""
    row_slice = rows or slice(0, tokens.shape[0])
    starts = cache.lengths[row_slice].clone()
    width = int(counts.max())
    chunk = torch.full((tokens.shape[0], width), pad_token)
    for row, (start, count) in enumerate(zip(starts.tolist(), counts.tolist(), strict=True)):
        chunk[row, :count] = tokens[row, start : start + count]
    return model(chunk, cache, rows=rows, new_counts=counts)


def decode_and_compare(
    model: Transformer, tokens: torch.Tensor, full: torch.Tensor, seed: int
) -> None:
    """Ragged prefill, one-token steps at different positions, ragged chunks, then equal-width
    chunks from different positions; every step's logits must equal ``full``'s."""
    batch = tokens.shape[0]
    generator = torch.Generator().manual_seed(seed)
    cache = KVCache(model.config, batch, SEQUENCE_LENGTH)

    def step(counts: torch.Tensor, ragged: bool) -> None:
        starts = cache.lengths.clone()
        if ragged:
            logits = feed_ragged(model, cache, tokens, counts)
        else:  # every row writes the same number of tokens, from its own position
            width = int(counts[0])
            index = starts.unsqueeze(1) + torch.arange(width)
            logits = model(tokens.gather(1, index), cache)
        assert_rows_match(logits, full, starts, counts)
        assert torch.equal(cache.lengths, starts + counts)

    step(torch.randint(1, 11, (batch,), generator=generator), ragged=True)  # prefill
    for _ in range(3):
        step(torch.ones(batch, dtype=torch.long), ragged=False)
    step(torch.randint(1, 5, (batch,), generator=generator), ragged=True)
    step(torch.full((batch,), 2), ragged=False)


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_incremental_decoding_equals_full_forward(scheme: str, batch: int) -> None:
    model = random_model(scheme, seed=1)
    tokens = random_tokens(batch, SEQUENCE_LENGTH, seed=2)
    with torch.no_grad():
        decode_and_compare(model, tokens, model(tokens), seed=3)


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_uniform_rows_take_the_fast_paths_and_agree(scheme: str) -> None:
    """All rows at one position: causal prefill from 0, a chunk from position 6, single steps."""
    model = random_model(scheme, seed=4)
    tokens = random_tokens(3, 12, seed=5)
    cache = KVCache(model.config, 3, 12)
    with torch.no_grad():
        full = model(tokens)
        pieces = [model(tokens[:, :6], cache), model(tokens[:, 6:9], cache)]
        pieces += [model(tokens[:, p : p + 1], cache) for p in range(9, 12)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_last_only_picks_each_rows_last_real_token(scheme: str) -> None:
    model = random_model(scheme, seed=6)
    tokens = random_tokens(4, 10, seed=7)
    counts = torch.tensor([10, 3, 1, 7])
    cache = KVCache(model.config, 4, 10)
    with torch.no_grad():
        full = model(tokens)
        last = model(tokens, cache, new_counts=counts, last_only=True)
        uniform_last = model(tokens, last_only=True)
    torch.testing.assert_close(last, full[torch.arange(4), counts - 1], atol=ATOL, rtol=0)
    torch.testing.assert_close(uniform_last, full[:, -1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_writing_into_a_slice_of_a_bigger_cache(scheme: str) -> None:
    """Rows 2..4 of a 7-row cache serve a batch of 3; the other rows are left untouched."""
    model = random_model(scheme, seed=8)
    tokens = random_tokens(3, SEQUENCE_LENGTH, seed=9)
    neighbours = random_tokens(7, 5, seed=10)
    cache = KVCache(model.config, 7, SEQUENCE_LENGTH)
    rows = slice(2, 5)
    with torch.no_grad():
        full = model(tokens)
        model(neighbours, cache)  # fill every row, so a stray write would show
        cache.lengths[rows] = 0
        keys_before, lengths_before = cache.keys.clone(), cache.lengths.clone()

        prompt = torch.tensor([4, 9, 1])
        assert_rows_match(feed_ragged(model, cache, tokens, prompt, rows), full, 0 * prompt, prompt)
        for _ in range(2):
            starts = cache.lengths[rows].clone()
            step = tokens.gather(1, starts.unsqueeze(1))
            assert_rows_match(model(step, cache, rows=rows), full, starts, torch.ones(3).long())

    outside = [0, 1, 5, 6]
    assert torch.equal(cache.keys[:, outside], keys_before[:, outside])
    assert torch.equal(cache.lengths[outside], lengths_before[outside])
    assert torch.equal(cache.lengths[rows], prompt + 2)


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_move_row_keeps_the_sequence(scheme: str) -> None:
    """Row 3's (short) sequence moves into row 1, over a longer one whose stale slots remain."""
    model = random_model(scheme, seed=11)
    tokens = random_tokens(4, SEQUENCE_LENGTH, seed=12)
    cache = KVCache(model.config, 4, SEQUENCE_LENGTH)
    with torch.no_grad():
        full = model(tokens)
        feed_ragged(model, cache, tokens, torch.tensor([6, 15, 2, 4]))
        cache.move_row(3, 1)
        cache.reset(3)
        survivors = tokens[[0, 3, 2]]  # cache rows 0, 1, 2 now hold sequences 0, 3, 2
        expected = full[[0, 3, 2]]
        for _ in range(3):
            starts = cache.lengths[:3].clone()
            logits = model(survivors.gather(1, starts.unsqueeze(1)), cache, rows=slice(0, 3))
            assert_rows_match(logits, expected, starts, torch.ones(3).long())
        # a two-token chunk from different positions (non-uniform, no new_counts)
        starts = cache.lengths[:3].clone()
        chunk = survivors.gather(1, starts.unsqueeze(1) + torch.arange(2))
        logits = model(chunk, cache, rows=slice(0, 3))
    assert_rows_match(logits, expected, starts, torch.full((3,), 2))


def test_cache_full_is_raised_before_anything_is_written() -> None:
    model = random_model("rope", seed=13)
    tokens = random_tokens(2, 8, seed=14)
    cache = KVCache(model.config, 2, 8)
    with torch.no_grad():
        model(tokens[:, :6], cache)
        keys = cache.keys.clone()
        with pytest.raises(CacheFull, match="holds 8 positions"):
            model(tokens[:, :3], cache)
        with pytest.raises(CacheFull):  # only row 1's count goes past the end
            model(tokens[:, :3], cache, new_counts=torch.tensor([2, 3]))
        assert torch.equal(cache.lengths, torch.tensor([6, 6]))
        assert torch.equal(cache.keys, keys)
        model(tokens[:, 6:8], cache)  # exactly filling the cache is fine
    assert torch.equal(cache.lengths, torch.tensor([8, 8]))


def test_cache_rejects_rows_and_counts_that_do_not_fit_the_batch() -> None:
    model = random_model("rope", seed=15)
    cache = KVCache(model.config, 6, 16)
    tokens = random_tokens(2, 3, seed=16)
    with pytest.raises(ValueError, match="rows"):
        model(tokens, cache, rows=slice(2, 5))
    with pytest.raises(ValueError, match="new_counts"):
        model(tokens, cache, new_counts=torch.tensor([1, 4]))  # more than the 3 tokens given
    with pytest.raises(ValueError, match="new_counts"):
        model(tokens, cache, new_counts=torch.tensor([1, 2, 3]))
    assert torch.equal(cache.lengths, torch.zeros(6, dtype=torch.long))


@pytest.mark.parametrize("scheme", [s for s in ALL_SCHEMES if s != "none"])
def test_randomised_positions_move_the_logits(scheme: str) -> None:
    """The equality tests above would be vacuous if positions hardly mattered: removing the
    scheme from the randomised model must change its logits far beyond the tolerance."""
    model = random_model(scheme, seed=17)
    tokens = random_tokens(2, 16, seed=18)
    with torch.no_grad():
        with_positions = model(tokens)
        model.positional = SCHEMES["none"](model.config, None)
        without = model(tokens)
    assert (with_positions - without).abs().max() > 1000 * ATOL


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_training_mode_forward_equals_cached_path(scheme: str) -> None:
    """With dropout 0, train mode changes nothing: the no-cache forward equals cached decoding."""
    model = random_model(scheme, seed=19)
    tokens = random_tokens(3, SEQUENCE_LENGTH, seed=20)
    model.train()
    with torch.no_grad():
        full = model(tokens)
    model.eval()
    with torch.no_grad():
        decode_and_compare(model, tokens, full, seed=21)


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_gradient_reaches_every_trainable_parameter(scheme: str) -> None:
    # 30 tokens touch every t5 bucket of the tiny config (distances up to its max_distance 24).
    model = random_model(scheme, seed=22).train()
    tokens = random_tokens(2, 31, seed=23)
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        assert torch.isfinite(parameter.grad).all(), name
        assert parameter.grad.abs().sum() > 0, name
    if scheme == "mds":  # the MDS coordinates are fixed: a buffer, never a parameter
        coordinates = dict(model.named_buffers())["positional.coordinates"]
        assert not coordinates.requires_grad and coordinates.grad is None
        assert "positional.coordinates" not in dict(model.named_parameters())


def test_gelu_tanh_is_gpt2s_approximation() -> None:
    model = random_model("learned", mlp="gelu_tanh")
    mlp = model.blocks[0].mlp
    x = torch.randn(3, 5, model.config.d_model)
    hidden = mlp.up(x)
    gpt2_gelu = (
        0.5 * hidden * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (hidden + 0.044715 * hidden**3)))
    )
    torch.testing.assert_close(mlp(x), mlp.down(gpt2_gelu), atol=1e-6, rtol=1e-5)
    exact = random_model("learned", mlp="gelu")
    exact.load_state_dict(model.state_dict())
    assert not torch.allclose(exact.blocks[0].mlp(x), mlp(x), atol=1e-7, rtol=0)


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("scheme", ["rope", "alibi", "learned"])
def test_grouped_query_attention_decodes_as_the_full_forward(scheme: str, kv_heads: int) -> None:
    """Fewer key/value heads than query heads (1: multi-query), qk_norm on: the cache holds
    only the key/value heads, and every cached path still equals the full forward."""
    model = random_model(scheme, seed=6, n_kv_heads=kv_heads, qk_norm=True)
    assert model.blocks[0].attention.qkv.out_features == (4 + 2 * kv_heads) * 8
    tokens = random_tokens(3, SEQUENCE_LENGTH, seed=7)
    with torch.no_grad():
        decode_and_compare(model, tokens, model(tokens), seed=8)
    assert KVCache(model.config, 3, 8).keys.shape == (2, 3, kv_heads, 8, 8)


def test_grouped_query_attention_shares_each_key_head_between_its_query_heads() -> None:
    """With one key/value head per two query heads, the model equals the multi-head model whose
    key and value heads are those heads repeated (Hugging Face's repeat_kv)."""
    grouped = random_model("rope", seed=9, n_kv_heads=2)
    multi_head = Transformer(grouped.config.replace(n_kv_heads=None)).eval()
    state = grouped.state_dict()
    for layer in range(grouped.config.n_layers):
        name = f"blocks.{layer}.attention.qkv.weight"
        queries, keys, values = state[name].split([32, 16, 16])
        heads = [
            part.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
            for part in (keys, values)
        ]
        state[name] = torch.cat([queries, *heads])
    multi_head.load_state_dict(state)
    tokens = random_tokens(2, 10, seed=10)
    with torch.no_grad():
        torch.testing.assert_close(grouped(tokens), multi_head(tokens), atol=1e-5, rtol=0)


def test_the_traced_pass_is_the_plain_pass_until_changed() -> None:
    """The trace's pass (uncached: an intervention has no meaning for a cached decode) is the
    plain forward bit for bit, with or without an empty intervention; an offset changes an
    absolute scheme's."""
    model = random_model("sinusoidal", seed=6)
    tokens = random_tokens(1, 8, seed=7)
    with torch.no_grad():
        plain = model(tokens)
        torch.testing.assert_close(model.traced_forward(tokens), plain, atol=0, rtol=0)
        traced = model.traced_forward(tokens, AttentionRecorder(), Intervention())
        torch.testing.assert_close(traced, plain, atol=0, rtol=0)
        moved = model.traced_forward(tokens, intervention=Intervention(position_offset=3))
    assert not torch.allclose(moved, plain)


def test_the_logit_lens_of_the_last_block_is_the_logits() -> None:
    model = random_model("alibi", seed=8)
    tokens = random_tokens(2, 9, seed=9)
    recorder = AttentionRecorder()
    with torch.no_grad():
        logits = model.traced_forward(tokens, recorder)
        lens = model.unembed(torch.stack(recorder.residuals))  # [L, B, T, V]
    assert len(recorder.residuals) == model.config.n_layers
    torch.testing.assert_close(lens[-1], logits, atol=0, rtol=0)
    assert not torch.allclose(lens[0], logits)  # earlier layers read differently


def test_pinned_members_are_the_modules_own_after_loading_moving_and_reassigning() -> None:
    # pin_members gives each member a plain attribute; what the forward reads must still be
    # the module's current member after the ways ordinal changes one.
    model, source = random_model("rope", seed=1), random_model("rope", seed=2)
    tokens = random_tokens(2, 9, seed=3)
    model.load_state_dict(source.state_dict())
    model.to(torch.float64).to(torch.float32)
    torch.testing.assert_close(model(tokens), source(tokens), atol=0, rtol=0)
    attention = model.blocks[0].attention
    attention.proj = torch.nn.Linear(attention.proj.in_features, attention.proj.out_features)
    attention.proj.weight = torch.nn.Parameter(torch.zeros_like(attention.proj.weight))
    assert attention.proj is attention._modules["proj"]
    assert attention.proj.weight is attention.proj._parameters["weight"]
    assert not torch.allclose(model(tokens), source(tokens))  # the new zero projection is used
    for module in model.modules():
        for table in (module._parameters, module._modules):
            for name, member in table.items():
                assert getattr(module, name) is member, name


def test_a_buffer_moved_by_to_is_the_one_the_forward_reads() -> None:
    # .to() puts a new buffer into the module's table (mds keeps its coordinates in one).
    model, source = random_model("mds", seed=1), random_model("mds", seed=1)
    tokens = random_tokens(2, 9, seed=3)
    doubled = model.double()
    coordinates = dict(doubled.named_buffers())["positional.coordinates"]
    assert doubled.positional.coordinates is coordinates and coordinates.dtype == torch.float64
    torch.testing.assert_close(doubled(tokens), source.double()(tokens), atol=0, rtol=0)
    doubled.positional.coordinates = torch.zeros_like(coordinates)  # a buffer assigned anew
    assert doubled.positional.coordinates is doubled.positional._buffers["coordinates"]


@pytest.mark.parametrize("biased", [False, True])
def test_bfloat16_training_attention_is_float32_attention_rounded(biased: bool) -> None:
    """Training in bfloat16 on a CPU, the fused attention runs in float32 (its bfloat16 backward
    is the slow one): the output is float32 SDPA rounded to bfloat16, and the gradients come
    back in bfloat16. A bias that needs its own gradient keeps the bfloat16 path."""
    generator = torch.Generator().manual_seed(0)
    queries, keys, values = (
        torch.randn(2, 4, 16, 8, generator=generator).bfloat16().requires_grad_() for _ in "qkv"
    )
    bias = torch.randn(2, 4, 16, 16, generator=generator).bfloat16()
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    additive = bias.masked_fill(~causal, float("-inf")).requires_grad_(biased)
    out = attend(queries, keys, values, AttentionMask(additive, is_causal=False), 0.0, False)
    assert out.dtype == torch.bfloat16
    in_float32 = F.scaled_dot_product_attention(
        queries.float(), keys.float(), values.float(), attn_mask=additive.float()
    )
    in_bfloat16 = F.scaled_dot_product_attention(queries, keys, values, attn_mask=additive)
    expected = in_bfloat16 if biased else in_float32.bfloat16()
    assert torch.equal(out, expected)
    out.sum().backward()
    assert all(
        t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (queries, keys, values)
    )


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_ragged_decoding_past_the_trained_length_equals_the_full_forward(scheme: str) -> None:
    """Rows at different lengths, fed chunks of different widths, to 60 tokens (the tiny
    models train at 48): each chunk's logits are the full forward's (irope's temperature and
    window, stick-breaking's process and PoPE's wide keys all read the cache)."""
    model = random_model(scheme, seed=8)
    tokens = random_tokens(3, 60, seed=9)
    cache = KVCache(model.config, 3, 60)
    steps = [torch.tensor([5, 17, 2])] + [torch.ones(3, dtype=torch.long)] * 3  # then to 60:
    left = 60 - sum(steps)  # [52, 40, 55] over 8 chunks of (about) equal widths per row
    steps += [(left * (k + 1)) // 8 - (left * k) // 8 for k in range(8)]
    with torch.no_grad():
        full = model(tokens)
        for counts in steps:
            starts = cache.lengths.clone()
            assert_rows_match(feed_ragged(model, cache, tokens, counts), full, starts, counts)
    assert cache.lengths.tolist() == [60, 60, 60]
