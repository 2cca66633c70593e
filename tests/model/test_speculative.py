"""Exact speculative decoding (``model.speculative`` through ``model.decode.DecodeBatch``).

Each property is the issue's: greedy completions are identical with and without it on every
shipped model that can verify (50 prompts each, decoded in one batch so speculating rows share
steps with rows that do not); seeded sampling is identical too, since each position is drawn
with the uniform it would have taken; and verification keeps the target distribution, tested
statistically against the model's own next-token distributions.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from lab.corpus import load_corpus
from model import kernels
from model.checkpoint import load_checkpoint
from model.decode import DecodeBatch, Row, Sampled, Tokens
from model.generate import generate
from model.sampling import RowSampler, sampling_stages
from model.sampling_params import SamplingParams
from model.speculative import MAX_WAIT, NgramLookup, Speculation, refusal
from model.tokenizer import encode_prompt
from tests.test_shipped_checkpoints import SHIPPED, SHIPPED_MODELS

SPECULATION = Speculation(4)
NEW_TOKENS = 32


def latest_continuation(tokens: list[int], n_min: int, n_max: int, most: int) -> list[int]:
    """The definition, by brute force: the tokens after the latest earlier occurrence of the
    longest suffix n-gram (n_max down to n_min) that occurred before."""
    for n in range(min(n_max, len(tokens)), n_min - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + most]
    return []


@pytest.mark.parametrize("seed", range(20))
def test_the_lookup_proposes_what_followed_the_latest_earlier_match(seed: int) -> None:
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
    lookup, prompt = NgramLookup(2, 4), min(3, len(tokens))
    for end in range(prompt, len(tokens) + 1):  # grown a token at a time, as a row decodes
        lookup.catch_up(tokens[:prompt], tokens[prompt:end])
        assert lookup.tokens == tokens[:end]
        assert lookup.propose(3) == latest_continuation(tokens[:end], 2, 4, 3)


def test_a_row_that_keeps_missing_backs_off_and_a_hit_ends_it() -> None:
    lookup = NgramLookup(1, 2)
    lookup.extend([1, 2, 1, 2, 1])
    waits = []
    for _ in range(6):
        assert lookup.propose(2) == [2, 1]
        lookup.verified(0)
        waits.append(0)
        while not lookup.propose(2):
            waits[-1] += 1
    assert waits == [1, 2, 4, 8, MAX_WAIT, MAX_WAIT]
    lookup.verified(1)
    assert lookup.propose(2) == [2, 1]  # a kept draft: no waiting
    lookup.verified(0)
    assert lookup.propose(2) == []  # and a miss after it starts over at one step


def prompts(tokenizer: object, count: int = 50) -> list[list[int]]:
    """Shakespeare from the validation plays, half of it as is and half a passage said twice
    (where the models' own text tends to repeat, so that drafts are kept)."""
    text = "".join(load_corpus().validation)
    rng = random.Random(0)
    chosen = []
    for index in range(count):
        start = rng.randrange(len(text) - 200)
        passage = text[start : start + 60 + index % 40]
        chosen.append(passage if index % 2 else passage + passage)
    return [encode_prompt(tokenizer, prompt)[-80:] for prompt in chosen]  # type: ignore[arg-type]


@pytest.fixture
def verified_steps(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts the draft tokens proposed and kept in the steps that follow."""
    counts: Counter[str] = Counter()
    step = DecodeBatch.step

    def counting(self: DecodeBatch, chunks: object = ()) -> Sampled | None:
        sampled = step(self, chunks)  # type: ignore[arg-type]
        if sampled is not None:
            counts["drafted"] += sum(sampled.drafted.values())
            counts["kept"] += sum(len(kept) for kept in sampled.accepted.values())
        return sampled

    monkeypatch.setattr(DecodeBatch, "step", counting)
    yield counts


@pytest.mark.parametrize("name", sorted(SHIPPED_MODELS))
def test_greedy_completions_are_identical_with_speculation(
    name: str, verified_steps: Counter[str]
) -> None:
    model, tokenizer = load_checkpoint(SHIPPED / name)[:2]
    why = refusal(model)
    if kernels.active() is None or model.decode_backend == "torch":
        # the torch blocks (no kernel here, or a scheme the kernel refuses): it says why, and
        # decoding says so too; PaTH's first reason is its cached keys, turned by every pass
        expected = "decode backend" if model.positional.prefix_stable else "not prefix-stable"
        assert why is not None and expected in why
        with pytest.raises(ValueError, match=f"speculative decoding: .*{expected}"):
            generate(model, tokenizer, ["a"], speculation=SPECULATION)
        return
    assert why is None, why  # every other shipped model is prefix-stable and on the kernel
    batch = prompts(tokenizer)
    plain = generate(model, tokenizer, batch, max_new_tokens=NEW_TOKENS)
    assert verified_steps["drafted"] == 0
    fast = generate(model, tokenizer, batch, max_new_tokens=NEW_TOKENS, speculation=SPECULATION)
    for ours, theirs in zip(fast, plain, strict=True):
        assert ours.token_ids == theirs.token_ids
        assert ours.finish_reason == theirs.finish_reason
    assert verified_steps["kept"] > 0, verified_steps  # verification did keep drafts


@pytest.mark.parametrize("name", ["rope", "cope"])  # a rotation, a data-dependent bias
def test_every_kernel_variant_verifies_exactly(
    name: str, every_isa: str, verified_steps: Counter[str]
) -> None:
    """The AVX2 and scalar variants too (forced here on an AVX-512 CPU): exactness rests on each
    variant computing a pass row alone."""
    model, tokenizer = load_checkpoint(SHIPPED / name)[:2]
    assert refusal(model) is None and kernels.active() == every_isa
    batch = prompts(tokenizer, 16)  # fewer than above: the scalar variant is slow
    plain = generate(model, tokenizer, batch, max_new_tokens=NEW_TOKENS)
    fast = generate(model, tokenizer, batch, max_new_tokens=NEW_TOKENS, speculation=SPECULATION)
    assert [c.token_ids for c in fast] == [c.token_ids for c in plain]
    assert verified_steps["kept"] > 0, verified_steps


@pytest.mark.skipif(kernels.active() is None, reason="speculation needs the CPU decode kernel")
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.1, top_p=0.9, top_k=40, seed=2),
        SamplingParams(temperature=0.7, min_p=0.05, logit_bias=((11, 3.0),), seed=3),
    ],
)
def test_seeded_completions_are_identical_with_speculation(
    params: SamplingParams, verified_steps: Counter[str]
) -> None:
    """Each position is drawn with the uniform the row would have drawn it with, and the
    uniforms of discarded positions go back: a seeded row's tokens do not change. Beside it in
    the batch, rows that cannot speculate (a repetition penalty, logprobs) decode as usual."""
    model, tokenizer = load_checkpoint(SHIPPED / "rope")[:2]
    penalised = SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=4)
    batch = prompts(tokenizer, 24)
    settings = [params if index % 3 else penalised for index in range(len(batch))]
    plain = generate(model, tokenizer, batch, max_new_tokens=2 * NEW_TOKENS, sampling=settings)
    fast = generate(
        model,
        tokenizer,
        batch,
        max_new_tokens=2 * NEW_TOKENS,
        sampling=settings,
        speculation=Speculation(4, ngram_min=1),  # sampled text repeats less: short matches
    )
    assert [c.token_ids for c in fast] == [c.token_ids for c in plain]
    assert verified_steps["kept"] > 0, verified_steps


def chi_square_critical(df: int, z: float = 3.72) -> float:
    """The chi-square statistic's value exceeded with probability ~1e-4 (z = 3.72) under the
    null, by the Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(observed: Counter[int], probs: torch.Tensor, total: int) -> tuple[float, int]:
    """Pearson's statistic of ``observed`` draws against ``probs`` [V], the tokens expected
    fewer than 5 times pooled into one cell → (statistic, degrees of freedom)."""
    expected = probs * total
    big = (expected >= 5).nonzero().flatten().tolist()
    cells = [(observed[token], float(expected[token])) for token in big]
    rest_observed = total - sum(count for count, _ in cells)
    rest_expected = total - sum(value for _, value in cells)
    if rest_expected >= 5:
        cells.append((rest_observed, rest_expected))
    else:
        assert rest_observed <= 5 + 4 * math.sqrt(max(rest_expected, 1.0))
    statistic = sum((count - value) ** 2 / value for count, value in cells)
    return statistic, len(cells) - 1


@pytest.mark.skipif(kernels.active() is None, reason="speculation needs the CPU decode kernel")
@torch.inference_mode()
def test_verification_keeps_the_target_distribution() -> None:
    """Rows fed the same prompt and token, each proposing the same two drafts: the first new
    token follows the model's distribution p1 after them (the sampler's filters applied), and
    where it equals the first draft, the second follows p2 after that draft too. A verifier that
    kept drafts more often (or drew the correction from the wrong distribution) fails."""
    model, tokenizer = load_checkpoint(SHIPPED / "rope")[:2]
    params = SamplingParams(temperature=1.0, top_k=50)
    prompt = encode_prompt(tokenizer, "ROMEO:\nWhat light is this? It is the")
    fed = tokenizer.encode(" sun").ids[0]

    def target(ids: list[int]) -> torch.Tensor:
        logits = model(torch.tensor([ids]))[0, -1, :2048]
        return sampling_stages(logits, params)[-1].probs

    p1 = target([*prompt, fed])
    ranked = p1.argsort(descending=True).tolist()
    first_draft = ranked[1]  # likely enough that both branches are drawn often
    p2 = target([*prompt, fed, first_draft])
    drafts = [first_draft, int(p2.argmax())]
    rows_per_batch, batches = 64, 40
    firsts: Counter[int] = Counter()
    seconds: Counter[int] = Counter()
    for batch_index in range(batches):
        batch: DecodeBatch[Row] = DecodeBatch(
            model, rows_per_batch, 64, 2048, 0, speculation=SPECULATION
        )
        rows = [
            Row(
                Tokens(list(prompt), []),
                RowSampler(SamplingParams(temperature=1.0, top_k=50, seed=batch_index * 1000 + i)),
                max_new_tokens=8,
            )
            for i in range(rows_per_batch)
        ]
        batch.step([(row, len(prompt)) for row in rows])  # the prompts; their first draws
        batch.inputs[:rows_per_batch] = fed  # every row fed the same token after them
        for row in rows:
            row.tokens.generated_ids[:] = [fed]
        batch._propose = lambda: dict.fromkeys(range(rows_per_batch), drafts)  # type: ignore[method-assign]
        sampled = batch.step()
        assert sampled is not None
        for position in range(rows_per_batch):
            new = sampled.new_tokens(position)
            firsts[new[0]] += 1
            if new[0] == first_draft:
                seconds[new[1]] += 1
    total = rows_per_batch * batches
    for observed, probs in ((firsts, p1), (seconds, p2)):
        draws = sum(observed.values())
        assert draws > 200  # each branch is drawn often enough to test
        statistic, df = chi_square(observed, probs, draws)
        assert statistic < chi_square_critical(df), (statistic, df)
    assert abs(firsts[first_draft] / total - float(p1[first_draft])) < 4 * math.sqrt(
        float(p1[first_draft]) / total
    )


@pytest.mark.skipif(kernels.active() is None, reason="speculation needs the CPU decode kernel")
def test_rope_dynamic_scaling_says_why_it_cannot_verify() -> None:
    model = load_checkpoint(
        SHIPPED / "rope", positional_overrides={"scaling": "dynamic", "scaling_factor": 2.0}
    )[0]
    why = refusal(model)
    assert why is not None and "prefix-stable" in why
    with pytest.raises(ValueError, match=r"speculative decoding: .*prefix-stable"):
        DecodeBatch(model, 2, 64, 2048, 0, speculation=SPECULATION)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"tokens": 0}, "num_speculative_tokens"),
        ({"tokens": 2, "ngram_min": 3, "ngram_max": 2}, "min ≤ max"),
        ({"tokens": 2, "method": "eagle"}, "not one of"),
    ],
)
def test_bad_speculation_settings_are_refused(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Speculation(**arguments)
