"""The decode core (``model.decode.DecodeBatch``) without a server: sequences that join and
leave at random steps, some with their prompt fed in random chunks (so rows are moved around by
compaction while one is still prefilling), decode exactly the tokens they decode alone."""

from __future__ import annotations

import random

import pytest
import torch

from model.decode import GROW_FROM, DecodeBatch, Row, Tokens
from model.generate import decode_tokens, generate
from model.kernels import decode_step
from model.sampling import RowSampler, SamplingParams
from model.transformer import Transformer
from tests.model.conftest import TINY_VOCAB, random_model, random_tokens

MAX_LENGTH = 64
SETTINGS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.9, top_k=20, seed=3),
    SamplingParams(temperature=1.0, top_p=0.9, min_p=0.02, seed=5),
    SamplingParams(temperature=0.0, repetition_penalty=1.5),
    SamplingParams(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.5, seed=7),
]


class Sequence:
    """One scripted sequence: its prompt, settings and how many tokens it wants."""

    def __init__(self, rng: random.Random, seed: int) -> None:
        length = rng.randint(1, 30)
        self.prompt = random_tokens(1, length, seed)[0].tolist()
        self.params = rng.choice(SETTINGS)
        self.wanted = rng.randint(1, 16)
        # Half say how many tokens they want, so that a growing cache reserves them on joining.
        room = self.wanted if rng.random() < 0.5 else None
        self.row = Row(Tokens(self.prompt, []), RowSampler(self.params), max_new_tokens=room)
        self.fed = 0  # prompt tokens given to the batch

    @property
    def finished(self) -> bool:
        return len(self.row.tokens.generated_ids) >= self.wanted


def run_schedule(batch: DecodeBatch, sequences: list[Sequence], rng: random.Random) -> set[int]:
    """Drive ``batch`` with random arrivals, chunk sizes and cancellations; returns the
    cancelled sequences' positions. Checks the row layout after every step."""
    waiting, cancelled = list(range(len(sequences))), set()
    active: list[Sequence] = []
    while waiting or active:
        if active and rng.random() < 0.1:
            victim = rng.choice(active)
            batch.remove([victim.row])
            active.remove(victim)
            cancelled.add(sequences.index(victim))
        chunks = []
        partial = next((s for s in active if s.fed < len(s.prompt)), None)
        if partial is not None:
            chunks.append(partial)
        while waiting and batch.free > len([c for c in chunks if c.row.index is None]):
            if chunks and chunks[-1].fed + 1 < len(chunks[-1].prompt):
                break  # only the last chunk may leave its prompt unfinished
            if rng.random() < 0.5 and (chunks or batch.decoding):
                break
            chunks.append(sequences[waiting.pop(0)])
            active.append(chunks[-1])
        plan = []
        for index, sequence in enumerate(chunks):
            left = len(sequence.prompt) - sequence.fed
            last = index == len(chunks) - 1
            count = rng.randint(1, left) if last else left
            sequence.fed += count
            plan.append((sequence.row, count))
        sampled = batch.step(plan)
        if sampled is not None:
            for row, token in zip(sampled.rows, sampled.tokens, strict=True):
                row.tokens.generated_ids.append(token)
            leaving = [s for s in active if s.finished]
            batch.remove([s.row for s in leaving])
            for sequence in leaving:
                active.remove(sequence)
        check_layout(batch, active)
    return cancelled


def check_layout(batch: DecodeBatch, active: list[Sequence]) -> None:
    """Rows packed at the front, decoding rows first, each cache row as long as its tokens."""
    assert [row.index for row in batch.members] == list(range(len(batch)))
    assert {id(s.row) for s in active} == {id(row) for row in batch.members}
    for position, row in enumerate(batch.members):
        sequence = next(s for s in active if s.row is row)
        decoding = position < batch.decoding
        assert decoding == (sequence.fed == len(sequence.prompt))
        expected = sequence.fed + max(len(row.tokens.generated_ids) - 1, 0)  # last token: fed next
        assert int(batch.cache.lengths[position]) == expected


@pytest.mark.parametrize(
    ("scheme", "grow"),
    [
        ("rope", True),
        ("learned", False),
        ("alibi", True),
        ("t5", False),
        ("fox", True),  # its key state travels with rows that move, grow and reset
        ("cope", False),
        ("fire", True),
    ],
)
def test_rows_joining_leaving_and_prefilled_in_chunks_decode_as_alone(
    scheme: str, grow: bool
) -> None:
    """``grow``: the cache starts with fewer rows and positions than the batch may need."""
    rng = random.Random(scheme)
    model = random_model(scheme, seed=1)
    batch = DecodeBatch(
        model, max_rows=6, max_length=MAX_LENGTH, vocab=TINY_VOCAB, filler=0, grow=grow
    )
    sequences = [Sequence(rng, seed) for seed in range(12)]
    with torch.inference_mode():
        cancelled = run_schedule(batch, sequences, rng)

    assert int(batch.cache.lengths.sum()) == 0  # every row was reset when it left
    if grow:
        batch.shrink()  # an empty batch keeps its growth until asked to give it back
        assert batch.cache.allocated == GROW_FROM
    for index, sequence in enumerate(sequences):
        alone = [
            t for (t,) in decode_tokens(model, [sequence.prompt], sequence.wanted, sequence.params)
        ]
        got = sequence.row.tokens.generated_ids
        assert got == (alone[: len(got)] if index in cancelled else alone), index


def test_a_growing_cache_grows_when_rows_join_and_never_while_they_decode() -> None:
    """Rows that say how many tokens they may generate get the room for all of them in the
    step that admits them: no reallocation (which stops every row) while they decode, and the
    same tokens as an offline batch, whose cache never grows."""
    model = random_model("rope", seed=2)
    batch = DecodeBatch(model, max_rows=8, max_length=256, vocab=TINY_VOCAB, filler=0, grow=True)
    wanted = 100
    prompts = [random_tokens(1, 5 + index, index)[0].tolist() for index in range(6)]
    rows = [
        Row(Tokens(prompt, []), RowSampler(SETTINGS[0]), max_new_tokens=wanted)
        for prompt in prompts
    ]
    with torch.inference_mode():
        sampled = batch.step([(row, len(row.tokens.prompt_ids)) for row in rows])
        generation = batch.cache.generation
        assert batch.cache.allocated[1] >= len(prompts[-1]) + wanted > GROW_FROM[1]
        for _ in range(wanted - 1):
            assert sampled is not None
            for row, token in zip(sampled.rows, sampled.tokens, strict=True):
                row.tokens.generated_ids.append(token)
            sampled = batch.step()
        assert sampled is not None
        for row, token in zip(sampled.rows, sampled.tokens, strict=True):
            row.tokens.generated_ids.append(token)
    assert batch.cache.generation == generation
    alone = list(decode_tokens(model, prompts, wanted, SETTINGS[0]))
    for index, row in enumerate(rows):
        assert row.tokens.generated_ids == [step[index] for step in alone]


def test_chunks_out_of_row_order_are_refused() -> None:
    model = random_model("rope")
    batch = DecodeBatch(model, max_rows=4, max_length=MAX_LENGTH, vocab=TINY_VOCAB, filler=0)
    first, second = (Row(Tokens([1, 2, 3, 4], []), RowSampler(SamplingParams(0.0))) for _ in "ab")
    with torch.inference_mode():
        assert batch.step([(first, 2)]) is None  # a partial prompt: nothing to sample yet
        with pytest.raises(ValueError, match="only the last chunk"):
            batch.step([(first, 1), (second, 4)])  # first is still unfinished
        sampled = batch.step([(first, 2), (second, 4)])
    assert sampled is not None and sampled.rows == [first, second]
    assert batch.cache.lengths[:2].tolist() == [4, 4]


def test_a_row_that_fails_to_sample_is_reported_and_the_others_draw_as_alone() -> None:
    model = random_model("rope")
    batch = DecodeBatch(model, max_rows=3, max_length=MAX_LENGTH, vocab=TINY_VOCAB, filler=0)
    prompts = random_tokens(3, 5, seed=2).tolist()
    params = SamplingParams(temperature=0.9, seed=1)
    rows = [Row(Tokens(p, []), RowSampler(params)) for p in prompts]
    broken = rows[1].sampler
    broken.next_uniform = lambda: (_ for _ in ()).throw(RuntimeError("broken"))  # type: ignore[method-assign]
    with torch.inference_mode():
        sampled = batch.step([(row, 5) for row in rows])
    assert sampled is not None and list(sampled.failures) == [1]
    for index in (0, 2):
        alone = next(decode_tokens(model, [prompts[index]], 1, params))
        assert sampled.tokens[index] == alone[0]


def test_generate_drops_finished_rows_and_matches_each_row_alone(tiny_tokenizer: object) -> None:
    model = random_model("alibi", seed=4, vocab_size=TINY_VOCAB)
    prompts = ["To be, or not", "Now is", "All the world's a stage, and all"]
    settings = [SamplingParams(temperature=0.8, seed=seed) for seed in range(3)]
    together = generate(model, tiny_tokenizer, prompts, max_new_tokens=12, sampling=settings)  # type: ignore[arg-type]
    for prompt, params, result in zip(prompts, settings, together, strict=True):
        (alone,) = generate(model, tiny_tokenizer, [prompt], max_new_tokens=12, sampling=params)  # type: ignore[arg-type]
        assert result.token_ids == alone.token_ids
        assert all(token < tiny_tokenizer.get_vocab_size() for token in result.token_ids)  # type: ignore[attr-defined]


@pytest.mark.skipif(not decode_step.ready(), reason="the decode-step kernel needs AVX-512")
def test_prompts_ride_the_decode_kernels_pass_and_never_the_torch_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the kernel applies, a step's prompt chunks go into the decoding rows' pass (one
    ``decode_entries`` call a step that admits), alone or beside decoding rows, so a prompt's
    numbers never depend on its batch: the torch prefill never runs."""
    model = random_model("rope", seed=3)
    passes: list[int] = []
    entries = Transformer.decode_entries

    def counted(self: Transformer, tokens: torch.Tensor, *args: object) -> torch.Tensor:
        passes.append(tokens.shape[0])
        return entries(self, tokens, *args)  # type: ignore[arg-type]

    def refused(*_: object) -> None:
        raise AssertionError("a prompt went through the torch blocks")

    monkeypatch.setattr(Transformer, "decode_entries", counted)
    monkeypatch.setattr(DecodeBatch, "_prefill", refused)
    batch = DecodeBatch(model, max_rows=4, max_length=MAX_LENGTH, vocab=TINY_VOCAB, filler=0)
    rows = [
        Row(Tokens(random_tokens(1, n, seed=n)[0].tolist(), []), RowSampler(SamplingParams()))
        for n in (5, 7)
    ]
    with torch.inference_mode():
        first = batch.step([(rows[0], 5)])  # alone: 5 pass rows
        assert first is not None
        rows[0].tokens.generated_ids.append(first.tokens[0])
        second = batch.step([(rows[1], 7)])  # beside one decoding row: 1 + 7
        assert second is not None and second.rows == rows
    assert passes == [5, 8]
