"""The decode-step kernel (model/kernels/decode_step.cpp) runs a cached one-token pass's blocks
as the torch blocks do — the same logits and the same cache — for every scheme and architecture
it takes, gives a row the same bits alone and in any batch, and applies only where it may."""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any

import pytest
import torch

from model.cache import KVCache
from model.kernels import decode_step
from model.kernels import linear as linear_kernel
from model.positional import SCHEMES
from model.transformer import Transformer
from tests.model.conftest import ALL_SCHEMES, random_model, random_tokens

# Every variant this CPU runs (tests/conftest.py); a kernel that fails to build fails here.
pytestmark = pytest.mark.usefixtures("every_isa")

# the schemes the kernel runs (tests/model/test_backend.py: the others declare they take torch)
BLOCK_SCHEMES = tuple(s for s in ALL_SCHEMES if SCHEMES[s].kernel_bias is not None)
ARCHITECTURES: list[dict[str, Any]] = [
    {"norm": "rmsnorm", "mlp": "swiglu"},
    {"bias": True, "mlp": "gelu"},
    {"bias": True, "mlp": "gelu_tanh", "norm_eps": 1e-6},
    {"mlp": "relu2", "n_kv_heads": 2},  # grouped-query attention
    {"positional": {"scheme": "rope", "fraction": 0.75}},  # p-RoPE: pairs left unturned
    {"positional": {"scheme": "rope", "rotary_fraction": 0.5}},  # half of each head rotated
    {"positional": {"scheme": "learned"}, "tie_embeddings": False},  # own logits weight
]


def decode_both_ways(model: Transformer, steps: int) -> None:
    """Three rows of ragged prompts (the cache's rows at different lengths), then ``steps``
    one-token passes on two caches, the kernel's and torch's: logits within 1e-5 at each
    step, the caches' keys and values too."""
    config = model.config
    lengths = (5, 9, 3)
    prompts = [random_tokens(1, n, seed=n)[0] for n in lengths]
    caches = [KVCache(config, rows=3, max_length=32) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            for row, prompt in enumerate(prompts):
                model(prompt[None], cache, rows=slice(row, row + 1))
        tokens = torch.stack([prompt[-1:] for prompt in prompts])  # [3, 1]
        for step in range(steps):
            assert decode_step.applies(model, torch.zeros(3, 1, dtype=torch.long))
            ours = model(tokens, caches[0], last_only=True)
            theirs = torch_blocks(model, tokens, caches[1])
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0, msg=f"step {step}")
            tokens = theirs.argmax(-1, keepdim=True)
    for ours_cache, theirs_cache in (
        (caches[0].keys, caches[1].keys),
        (caches[0].values, caches[1].values),
    ):
        torch.testing.assert_close(ours_cache, theirs_cache, atol=1e-5, rtol=0)
    assert torch.equal(caches[0].lengths, caches[1].lengths)
    if caches[0].states.numel():  # fox's log gates
        torch.testing.assert_close(caches[0].states, caches[1].states, atol=1e-5, rtol=0)


def torch_blocks(model: Transformer, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """The same pass with the kernel turned off."""
    applies = decode_step.applies
    decode_step.applies = lambda *_: False  # type: ignore[assignment]
    try:
        return model(tokens, cache, last_only=True)
    finally:
        decode_step.applies = applies


@pytest.mark.parametrize("scheme", BLOCK_SCHEMES)
def test_every_scheme_decodes_as_the_torch_blocks(scheme: str) -> None:
    decode_both_ways(random_model(scheme, seed=4), steps=12)


@pytest.mark.parametrize(
    "architecture", ARCHITECTURES, ids=lambda a: "-".join(map(str, a.values()))
)
def test_every_architecture_decodes_as_the_torch_blocks(architecture: dict[str, Any]) -> None:
    decode_both_ways(random_model("rope", seed=5, **architecture), steps=12)


def narrowed(model: Transformer) -> Transformer:
    """``model`` with every parameter rounded to a bfloat16 value, as the shipped checkpoints
    are: its projections then multiply on the tile unit, where the CPU has one."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.bfloat16().float())
    return model


# Float32 weights, and bfloat16 values (the shipped checkpoints': the tile path where there is one).
WEIGHTS = pytest.mark.parametrize("narrow", [False, True], ids=["float32", "bfloat16"])


@pytest.mark.parametrize("scheme", ["rope", "alibi", "learned", "fox", "cope"])
def test_bfloat16_valued_weights_decode_as_the_torch_blocks(scheme: str) -> None:
    """The shipped checkpoints' case: weights that are bfloat16 values (on the tile unit where
    the CPU has one) decode as the torch blocks do, within 1e-5."""
    model = narrowed(random_model(scheme, seed=4))
    qkv = decode_step.step_tensors(model)[0][2]
    assert qkv.dim() == (4 if linear_kernel.tiles_ready() else 3)  # the layout the path reads
    decode_both_ways(model, steps=12)


def test_a_bfloat16_valued_architecture_decodes_as_the_torch_blocks() -> None:
    model = random_model("rope", seed=5, norm="rmsnorm", mlp="swiglu", n_kv_heads=2)
    decode_both_ways(narrowed(model), steps=12)


@pytest.mark.parametrize("scheme", ["rope", "alibi", "t5", "learned", "none"])
@WEIGHTS
def test_a_rows_logits_are_the_same_bits_alone_and_in_a_batch(scheme: str, narrow: bool) -> None:
    """A prompt and one cached step: the projections (linear_core.h) and everything else are
    row by row, so a row's step is the same bits alone and in a batch of five."""
    model = random_model(scheme, seed=2)
    if narrow:
        narrowed(model)
    prompts = random_tokens(5, 9, seed=3)
    with torch.inference_mode():
        cache = KVCache(model.config, rows=5, max_length=16)
        model(prompts, cache)
        together = model(prompts[:, -1:], cache, last_only=True)
        for row in range(5):
            alone_cache = KVCache(model.config, rows=1, max_length=16)
            model(prompts[row : row + 1], alone_cache)
            alone = model(prompts[row : row + 1, -1:], alone_cache, last_only=True)
            assert torch.equal(alone[0], together[row]), row


@pytest.mark.parametrize("scheme", ["rope", "alibi", "fox", "cope"])
@WEIGHTS
def test_rows_split_across_threads_keep_their_bits(scheme: str, narrow: bool) -> None:
    """From eight rows on two threads, each thread takes its share of the rows through every
    block: the step's logits and the cache it writes are the same bits as on one thread."""
    model = random_model(scheme, seed=6)
    if narrow:
        narrowed(model)
    lengths = (5, 9, 3, 7, 8, 2, 6, 9, 4, 5, 3, 8)  # twelve rows at ragged lengths
    prompts = [random_tokens(1, n, seed=n + row)[0] for row, n in enumerate(lengths)]
    with torch.inference_mode():
        prefilled = KVCache(model.config, rows=len(lengths), max_length=16)
        for row, prompt in enumerate(prompts):
            model(prompt[None], prefilled, rows=slice(row, row + 1))
        tokens = torch.stack([prompt[-1:] for prompt in prompts])
        steps = []
        for threads in (1, 2):
            cache = copy.deepcopy(prefilled)
            torch.set_num_threads(threads)
            try:
                assert decode_step.parallel_threads() == threads
                logits = model(tokens, cache, last_only=True)
            finally:
                torch.set_num_threads(1)
            steps.append((logits, cache.keys, cache.values, cache.states))
    for one_thread, two_threads in zip(*steps, strict=True):
        assert torch.equal(one_thread, two_threads)


def ragged_batch(model: Transformer, rows: int = 12) -> tuple[KVCache, torch.Tensor]:
    """``rows`` rows prefilled at ragged lengths, and each row's last token to feed next."""
    lengths = [(5, 9, 3, 7, 8, 2, 6, 9, 4)[row % 9] for row in range(rows)]
    prompts = [random_tokens(1, n, seed=n + row)[0] for row, n in enumerate(lengths)]
    cache = KVCache(model.config, rows=len(lengths), max_length=16)
    with torch.inference_mode():
        for row, prompt in enumerate(prompts):
            model(prompt[None], cache, rows=slice(row, row + 1))
    return cache, torch.stack([prompt[-1:] for prompt in prompts])


@pytest.mark.parametrize("scheme", ["rope", "alibi", "fox", "cope"])
@pytest.mark.parametrize("order", ["helper_finishes", "helper_stalls", "free"])
@pytest.mark.parametrize("rows", [12, 20], ids=["one group", "two groups"])
@WEIGHTS
def test_attention_shared_with_the_helper_keeps_every_bit(
    scheme: str, order: str, rows: int, narrow: bool
) -> None:
    """From eight rows on one torch thread, a step may share its attention with the kernel's
    helper thread (from sixteen rows in two groups, one attended while the other is projected).
    Three steps give the same logits and cache, to the bit, as unshared, whether the helper's
    results are used ("helper_finishes": each group's first row in every block), computed again
    by the decode thread when the helper stalls ("helper_stalls": the same rows), or either, as
    the threads meet ("free")."""
    model = random_model(scheme, seed=6)
    if narrow:
        narrowed(model)
    prefilled, tokens = ragged_batch(model, rows)
    runs = []
    for shared in (False, True):
        cache = copy.deepcopy(prefilled)
        decode_step.share_large_steps(shared, order)
        before = decode_step.shared_rows()
        try:
            with torch.inference_mode():
                logits = [model(tokens, cache, last_only=True) for _ in range(3)]
        finally:
            decode_step.share_large_steps(False)
        after = decode_step.shared_rows()
        helped, taken = after[0] - before[0], after[1] - before[1]
        runs.append((logits, cache.keys, cache.values, cache.states))
    groups = 3 * model.config.n_layers * (2 if rows >= 16 else 1)  # attentions shared
    if order == "helper_finishes":
        assert helped >= groups and taken == 0
    elif order == "helper_stalls":
        assert taken >= groups and helped == 0
    for unshared, shared_run in zip(*runs, strict=True):
        if isinstance(unshared, list):
            assert all(torch.equal(a, b) for a, b in zip(unshared, shared_run, strict=True))
        else:
            assert torch.equal(unshared, shared_run)


def test_a_shared_step_lets_go_of_the_cache() -> None:
    """The helper's work holds the cache's tensors while a step runs, and lets go after (as that
    step ends, or as the next starts): the engine shrinks or drops an idle model's cache (~130 MB
    at 64 rows), which a hold would keep in memory."""
    model = random_model("rope", seed=6)
    cache, tokens = ragged_batch(model, 20)

    def holds() -> tuple[int, int]:
        return tuple(  # type: ignore[return-value]
            torch._C._storage_Use_Count(t.untyped_storage()._cdata)
            for t in (cache.keys, cache.values)
        )

    before = holds()
    decode_step.share_large_steps(True, "helper_finishes")
    try:
        with torch.inference_mode():
            model(tokens, cache, last_only=True)
    finally:
        decode_step.share_large_steps(False)
    assert decode_step.shared_rows()[0] > 0
    # Let go as the step ends, or, what the helper still held then, as the next step starts.
    other, other_tokens = ragged_batch(model, 1)
    deadline = time.monotonic() + 2
    while holds() != before and time.monotonic() < deadline:
        time.sleep(0.01)
        with torch.inference_mode():
            model(other_tokens, copy.deepcopy(other), last_only=True)
    assert holds() == before


def test_a_small_step_or_several_torch_threads_do_not_share() -> None:
    """Below eight rows, or with torch's own threads to split the rows, nothing is shared."""
    model = random_model("rope", seed=6)
    prefilled, tokens = ragged_batch(model)
    decode_step.share_large_steps(True, "helper_finishes")
    before = decode_step.shared_rows()
    try:
        with torch.inference_mode():
            model(tokens[:7], copy.deepcopy(prefilled), rows=slice(0, 7), last_only=True)
            torch.set_num_threads(2)
            try:
                model(tokens, copy.deepcopy(prefilled), last_only=True)
            finally:
                torch.set_num_threads(1)
    finally:
        decode_step.share_large_steps(False)
    assert decode_step.shared_rows() == before


def test_it_applies_only_to_one_token_per_row_without_gradients_in_float32() -> None:
    model = random_model("rope")
    one_token = torch.zeros(3, 1, dtype=torch.long)
    with torch.inference_mode():
        assert decode_step.applies(model, one_token)
        assert not decode_step.applies(model, torch.zeros(3, 2, dtype=torch.long))  # a prompt
        assert not decode_step.applies(copy.deepcopy(model).double(), one_token)
        assert not decode_step.applies(model, torch.zeros(65, 1, dtype=torch.long))
        for scheme in ("fox", "cope"):  # their bias from each layer's tensors: computed there
            assert decode_step.applies(random_model(scheme), one_token)
        assert not decode_step.applies(random_model("rope", qk_norm=True), one_token)
        model.train()
        assert not decode_step.applies(model, one_token)
    assert not decode_step.applies(model.eval(), one_token)  # gradients on


@pytest.mark.parametrize("scheme", ["rope", "t5"])
def test_bfloat16_valued_weights_read_narrow_decode_the_same_bits(
    scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off the tile path, a model whose weights are bfloat16 values (the shipped checkpoints')
    decodes through bfloat16 copies of its projections (half the bytes a step reads): the same
    logits and cache, bit for bit, as from its float32 weights."""
    monkeypatch.setattr(linear_kernel, "tiles_ready", lambda: False)
    model = narrowed(random_model(scheme, seed=8))
    tokens = random_tokens(4, 6, seed=1)
    results = []
    packed = decode_step.packed
    for narrow in (True, False):
        if not narrow:  # the same packed copy, widened to float32, gathered anew
            decode_step.packed = lambda weight: packed(weight).float()  # type: ignore[assignment]
            del model.__dict__["_ordinal_step_tensors"]
        try:
            read = decode_step.step_tensors(model)[0][2]  # the first block's QKV weight
            assert (read.dtype is torch.bfloat16) == narrow
            cache = KVCache(model.config, rows=4, max_length=16)
            with torch.inference_mode():
                model(tokens[:, :-1], cache)
                logits = model(tokens[:, -1:], cache, last_only=True)
        finally:
            decode_step.packed = packed
        results.append((logits, cache.keys, cache.values))
    for narrow, wide in zip(*results, strict=True):
        assert torch.equal(narrow, wide)


def test_a_token_outside_the_vocabulary_is_an_index_error_as_in_torch() -> None:
    model = random_model("rope")
    cache = KVCache(model.config, rows=1, max_length=8)
    outside = torch.tensor([[model.config.vocab_size]])
    with torch.inference_mode():
        assert decode_step.applies(model, outside)
        with pytest.raises(IndexError, match="outside the embedding"):
            model(outside, cache, last_only=True)
        assert int(cache.lengths[0]) == 0  # nothing was stored


def test_the_kept_step_tensors_follow_every_change_to_the_weights() -> None:
    """The kernel's tensors are kept on the model between steps and gathered again after an
    in-place change to a projection weight, new data under it, or a parameter assigned anew
    (a norm's): each time the kernel's step still equals the torch blocks'."""
    model = random_model("rope", seed=9)
    tokens = random_tokens(2, 5, seed=4)

    def kernel_and_torch_agree() -> None:
        caches = [KVCache(model.config, rows=2, max_length=8) for _ in range(2)]
        with torch.inference_mode():
            for cache in caches:
                model(tokens[:, :-1], cache)
            ours = model(tokens[:, -1:], caches[0], last_only=True)
            theirs = torch_blocks(model, tokens[:, -1:], caches[1])
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)

    kernel_and_torch_agree()
    blocks, _ = decode_step.step_tensors(model)
    kept, _ = decode_step.step_tensors(model)  # kept while nothing changes
    assert all(a is b for a, b in zip(kept, blocks, strict=True))
    block = model.blocks[0]
    with torch.no_grad():
        block.attention.qkv.weight.mul_(1.5)  # in place
    kernel_and_torch_agree()
    with torch.no_grad():
        block.mlp.up.weight.data = block.mlp.up.weight.data * 0.5  # new data
    kernel_and_torch_agree()
    norm = block.attention_norm
    norm.weight = torch.nn.Parameter(torch.full_like(norm.weight, 2.0))  # assigned anew
    kernel_and_torch_agree()
    assert decode_step.step_tensors(model)[0][0] is norm.weight


def decoding_rows_and_a_free_row(
    model: Transformer, decoding: int, length: int = 48
) -> tuple[KVCache, torch.Tensor]:
    """``decoding`` rows prefilled at ragged lengths and an empty row after them; each decoding
    row's next token."""
    cache = KVCache(model.config, rows=decoding + 1, max_length=length)
    prompts = [random_tokens(1, 2 + row % 7, seed=row)[0] for row in range(decoding)]
    with torch.inference_mode():
        for row, prompt in enumerate(prompts):
            model(prompt[None], cache, rows=slice(row, row + 1))
    tokens = [prompt[-1:] for prompt in prompts]
    return cache, torch.stack(tokens) if tokens else torch.zeros(0, 1, dtype=torch.long)


def pass_with_prompt(
    model: Transformer, cache: KVCache, tokens: torch.Tensor, prompt: torch.Tensor
) -> torch.Tensor:
    """One kernel pass: the decoding rows' ``tokens`` [d, 1] and ``prompt`` [P] into the row
    after them (KVCache.entries) → logits [d + P, vocab]."""
    plan = cache.entries([1] * len(tokens) + [len(prompt)])
    with torch.inference_mode():
        return model.decode_entries(torch.cat((tokens, prompt[:, None])), cache, plan)


@pytest.mark.parametrize("scheme", BLOCK_SCHEMES)
def test_a_prompt_in_the_decode_pass_is_what_the_torch_blocks_prefill(scheme: str) -> None:
    """Three decoding rows and a 9-token prompt in one kernel pass, each prompt token a pass
    row of its own: the decoding rows' logits and the prompt's (every position) within 1e-5 of
    the torch blocks' step and prefill, the cache (keys, values, fox's log gates) too."""
    model = random_model(scheme, seed=4)
    cache, tokens = decoding_rows_and_a_free_row(model, 3)
    theirs_cache = copy.deepcopy(cache)
    prompt = random_tokens(1, 9, seed=11)[0]
    ours = pass_with_prompt(model, cache, tokens, prompt)
    with torch.inference_mode():
        step = torch_blocks(model, tokens, theirs_cache)
        prefill = model(prompt[None], theirs_cache, rows=slice(3, 4))[0]  # [P, vocab]
    torch.testing.assert_close(ours, torch.cat((step, prefill)), atol=1e-5, rtol=0)
    for mine, theirs in zip(
        (cache.keys, cache.values, cache.states),
        (theirs_cache.keys, theirs_cache.values, theirs_cache.states),
        strict=True,
    ):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    assert cache.lengths.tolist() == theirs_cache.lengths.tolist()


@pytest.mark.parametrize("scheme", ["rope", "alibi", "t5", "fox", "cope"])
@WEIGHTS
def test_a_prompts_pass_rows_are_the_same_bits_alone_beside_rows_and_across_calls(
    scheme: str, narrow: bool
) -> None:
    """A 12-token prompt prefilled in the kernel's pass alone, beside 3 decoding rows, and beside
    58 (70 pass rows: two calls of at most MAX_ROWS, the prompt split between them): its
    logits and its cache row are the same bits each time."""
    model = random_model(scheme, seed=7)
    if narrow:
        narrowed(model)
    prompt = random_tokens(1, 12, seed=5)[0]
    runs = []
    for decoding in (0, 3, 58):
        cache, tokens = decoding_rows_and_a_free_row(model, decoding)
        logits = pass_with_prompt(model, cache, tokens, prompt)[decoding:]
        row = cache.slots(decoding, len(prompt))
        runs.append((logits, *(part for part in row if part is not None)))
    assert len(tokens) + len(prompt) > decode_step.MAX_ROWS  # the last run took two calls
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))


@pytest.mark.parametrize("scheme", ["rope", "fox", "cope"])
@pytest.mark.parametrize("order", ["helper_finishes", "helper_stalls", "free"])
def test_a_prompt_across_the_helpers_two_groups_keeps_every_bit(scheme: str, order: str) -> None:
    """6 decoding rows and a 14-token prompt: 20 pass rows in two groups of 10, the prompt in
    both. Shared with the helper, the later group's tokens attend what the earlier group's
    stored in each block: the same logits and cache, to the bit, as unshared."""
    model = random_model(scheme, seed=6)
    prefilled, tokens = decoding_rows_and_a_free_row(model, 6)
    prompt = random_tokens(1, 14, seed=9)[0]
    runs = []
    for shared in (False, True):
        cache = copy.deepcopy(prefilled)
        decode_step.share_large_steps(shared, order)
        try:
            logits = pass_with_prompt(model, cache, tokens, prompt)
        finally:
            decode_step.share_large_steps(False)
        runs.append((logits, cache.keys, cache.values, cache.states))
    for unshared, shared_run in zip(*runs, strict=True):
        assert torch.equal(unshared, shared_run)


def test_pass_rows_of_one_cache_row_must_be_consecutive_and_in_order() -> None:
    model = random_model("rope", seed=6)
    cache, _ = decoding_rows_and_a_free_row(model, 2)
    plan = cache.entries([1, 1, 2])  # slot rows 0, 1, 2, 2
    feed = torch.zeros(4, 1, dtype=torch.long)
    with torch.inference_mode():
        for slot_rows, message in (
            ([2, 0, 1, 2], "consecutive"),
            ([0, 1, 2, 3], "outside the cache's 3 rows"),
        ):
            bad = dataclasses.replace(plan, slot_rows=torch.tensor(slot_rows))
            with pytest.raises(RuntimeError, match=message):
                model.decode_entries(feed, cache, bad)
        backwards = dataclasses.replace(plan, positions=plan.positions.flip(0))
        with pytest.raises(RuntimeError, match="position order"):
            model.decode_entries(feed, cache, backwards)


def test_only_the_logits_asked_for_are_computed_and_they_are_the_same_bits() -> None:
    """A pass returns the logits of the rows asked for (the decoding rows and each prompt's last
    token, in the engine): the same bits as those rows of the whole pass, across two calls too;
    none asked for is an empty answer, and a row past the pass an error."""
    model = random_model("rope", seed=7)
    prompt = random_tokens(1, 12, seed=5)[0]
    for decoding in (3, 58):
        wanted = torch.tensor([0, 2, decoding + len(prompt) - 1])
        runs = []
        for rows in (None, wanted):
            cache, tokens = decoding_rows_and_a_free_row(model, decoding)
            plan = cache.entries([1] * decoding + [len(prompt)])
            with torch.inference_mode():
                runs.append(
                    model.decode_entries(torch.cat((tokens, prompt[:, None])), cache, plan, rows)
                )
        assert torch.equal(runs[0][wanted], runs[1])
    cache, tokens = decoding_rows_and_a_free_row(model, 3)
    with torch.inference_mode():
        none = model.decode_entries(
            tokens, cache, cache.entries([1] * 3), torch.zeros(0, dtype=torch.long)
        )
        assert none.shape == (0, model.config.vocab_size)
        with pytest.raises(RuntimeError, match="is not a row"):
            model.decode_entries(tokens, cache, cache.entries([1] * 3), torch.tensor([3]))
