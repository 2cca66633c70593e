"""Automatic prefix caching (``model.prefix_cache``) on the decode core: a prompt whose first
blocks are reused from an earlier prompt decodes the tokens and logprobs it decodes without
them, for every scheme; the kept blocks stay within their bound, least recently used out first."""

from __future__ import annotations

import pytest
import torch

from model.decode import DecodeBatch, Row, Tokens
from model.positional import SCHEMES
from model.prefix_cache import BLOCK, PrefixCache, block_digests
from model.sampling import RowSampler, SamplingParams
from tests.model.conftest import ALL_SCHEMES, TINY_VOCAB, random_model, random_tokens

MAX_LENGTH = 64
NEW_TOKENS = 6
SHARED = 2 * BLOCK + 3  # the tokens the two prompts share: two whole blocks and a bit


def held_tokens(prefix: PrefixCache) -> int:
    """The tokens the pool holds now: a block per digest kept."""
    return len(prefix._slots) * prefix.block


def decode(
    batch: DecodeBatch, prompt: list[int], params: SamplingParams, prefix: PrefixCache | None
) -> tuple[list[int], list[float], int]:
    """``prompt`` decoded alone in ``batch`` for NEW_TOKENS tokens, its first tokens reused
    from ``prefix`` where held; (tokens, their logprobs, the prompt tokens reused). The
    prompt's blocks are kept in ``prefix`` once prefilled."""
    row = Row(Tokens(prompt, []), RowSampler(params), logprobs=0)
    digests = block_digests(prompt)
    reused = 0
    if prefix is not None:
        reused = prefix.match(digests, len(prompt))
        index = batch.join(row)
        if reused:
            prefix.load(digests, reused, batch.cache, index)
    tokens, logprobs = [], []
    sampled = batch.step([(row, len(prompt) - reused)])
    if prefix is not None:
        prefix.store(digests, batch.cache, 0)
    while True:
        assert sampled is not None and sampled.logprobs is not None
        tokens.append(sampled.tokens[0])
        logprobs.append(sampled.logprobs[1][0])
        row.tokens.generated_ids.append(sampled.tokens[0])
        if len(tokens) == NEW_TOKENS:
            break
        sampled = batch.step()
    batch.remove([row])
    return tokens, logprobs, reused


# PaTH's cached keys carry the transitions of every later token, so no prefix is kept for it
# (the engine's test_engine_prefix.py checks it is given none).
PREFIX_STABLE = tuple(scheme for scheme in ALL_SCHEMES if not SCHEMES[scheme].rewrites_keys)


@pytest.mark.parametrize("scheme", PREFIX_STABLE)
@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=4)]
)
def test_a_reused_prefix_decodes_as_a_full_prefill(scheme: str, params: SamplingParams) -> None:
    model = random_model(scheme, seed=1)
    first = random_tokens(1, SHARED + 5, seed=2)[0].tolist()
    second = first[:SHARED] + random_tokens(1, 4, seed=3)[0].tolist()  # a new ending

    def batch() -> DecodeBatch:
        return DecodeBatch(model, 2, MAX_LENGTH, TINY_VOCAB, filler=0, grow=True)

    prefix = PrefixCache(model.config, 256)
    with torch.inference_mode():
        alone_tokens, alone_logprobs, _ = decode(batch(), second, params, None)
        cached_batch = batch()
        decode(cached_batch, first, params, prefix)
        tokens, logprobs, reused = decode(cached_batch, second, params, prefix)

    assert reused == 2 * BLOCK  # the whole blocks the prompts share, no more
    assert tokens == alone_tokens
    assert logprobs == pytest.approx(alone_logprobs, abs=1e-5)


def test_a_whole_prompt_held_still_feeds_its_last_token() -> None:
    model = random_model("rope", seed=1)
    prompt = random_tokens(1, 2 * BLOCK, seed=5)[0].tolist()
    prefix = PrefixCache(model.config, 256)
    params = SamplingParams(temperature=0.0)
    with torch.inference_mode():
        batch = DecodeBatch(model, 2, MAX_LENGTH, TINY_VOCAB, filler=0)
        first, first_logprobs, none = decode(batch, prompt, params, prefix)
        again, again_logprobs, reused = decode(batch, prompt, params, prefix)
    assert (none, reused) == (0, 2 * BLOCK - 1)
    assert again == first
    assert again_logprobs == pytest.approx(first_logprobs, abs=1e-5)


def test_only_a_chain_of_equal_blocks_from_the_start_matches() -> None:
    prompt = list(range(3 * BLOCK))
    changed_first = [1000, *prompt[1:]]
    assert block_digests(prompt)[1:] != block_digests(changed_first)[1:]  # chained
    assert block_digests(prompt)[:2] == block_digests(prompt[: 2 * BLOCK + 5])
    assert len(block_digests(prompt[: BLOCK - 1])) == 0


def test_the_kept_blocks_stay_within_their_bound_least_recently_used_out_first() -> None:
    model = random_model("fox", seed=1)  # fox: its key states are kept too
    capacity = 4 * BLOCK  # two prompts of two blocks
    prefix = PrefixCache(model.config, capacity)
    params = SamplingParams(temperature=0.0)

    def held(prompt: list[int]) -> int:
        return prefix.match(block_digests(prompt), len(prompt))

    with torch.inference_mode():
        batch = DecodeBatch(model, 2, MAX_LENGTH, TINY_VOCAB, filler=0)
        kept = random_tokens(1, 2 * BLOCK + 1, seed=100)[0].tolist()
        decode(batch, kept, params, prefix)
        previous: list[int] = []
        for seed in range(8):  # a stream of distinct prompts; ``kept`` is used after each
            prompt = random_tokens(1, 2 * BLOCK + 1, seed=seed)[0].tolist()
            *_, reused = decode(batch, prompt, params, prefix)
            assert reused == 0
            assert held_tokens(prefix) <= capacity and prefix.allocated_tokens <= capacity
            assert held(prompt) == held(kept) == 2 * BLOCK
            if previous:
                assert held(previous) == 0  # the least recently used made room
            *_, reused = decode(batch, kept, params, prefix)
            assert reused == 2 * BLOCK
            previous = prompt
        assert held_tokens(prefix) == capacity


def test_no_capacity_keeps_nothing() -> None:
    model = random_model("rope", seed=1)
    prefix = PrefixCache(model.config, BLOCK - 1)  # less than one block
    prompt = random_tokens(1, 2 * BLOCK + 1, seed=5)[0].tolist()
    with torch.inference_mode():
        batch = DecodeBatch(model, 2, MAX_LENGTH, TINY_VOCAB, filler=0)
        decode(batch, prompt, SamplingParams(temperature=0.0), prefix)
        *_, reused = decode(batch, prompt, SamplingParams(temperature=0.0), prefix)
    assert reused == 0 and prefix.allocated_tokens == 0


def test_rope_dynamic_scaling_and_path_are_not_prefix_stable_and_every_other_scheme_is() -> None:
    for scheme in ALL_SCHEMES:
        stable = random_model(scheme).positional.prefix_stable
        assert stable == (scheme in PREFIX_STABLE), scheme
    assert {"path", "pathfox"}.isdisjoint(PREFIX_STABLE)
    for scaling in ("linear", "ntk", "yarn"):
        positional = {"scheme": "rope", "scaling": scaling, "scaling_factor": 2.0}
        assert random_model("rope", positional=positional).positional.prefix_stable
    positional = {"scheme": "rope", "scaling": "dynamic", "scaling_factor": 2.0}
    assert not random_model("rope", positional=positional).positional.prefix_stable
