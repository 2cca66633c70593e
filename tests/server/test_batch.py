"""DecodeBatch without HTTP: sequences that join and leave at random steps (so rows are moved
around by compaction) decode exactly the tokens they decode alone with ``generate()``."""

from __future__ import annotations

import random

import pytest
import torch

from model.generate import SequenceState, StopMatcher, encode_prompt, generate
from model.sampling import SamplingParams
from model.tokenizer import IncrementalDecoder, special_ids, token_bytes
from server.batch import DecodeBatch
from server.job import Job
from server.service import context_limit
from tests.server.conftest import CONTEXT_LENGTH, MAX_POSITIONS, TEXT, tiny_model, tiny_tokenizer

TOKENIZER = tiny_tokenizer()
TABLE = token_bytes(TOKENIZER)
SPECIALS = special_ids(TOKENIZER)


def random_job(rng: random.Random) -> Job:
    line = rng.choice(TEXT)
    start = rng.randrange(len(line) - 10)
    prompt_ids = encode_prompt(TOKENIZER, line[start : start + rng.randint(1, 30)])
    params = rng.choice(
        [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.9, top_k=20, seed=rng.randrange(1000)),
            SamplingParams(temperature=1.0, top_p=0.9, min_p=0.02, seed=rng.randrange(1000)),
            SamplingParams(temperature=0.0, repetition_penalty=1.5),
            SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=rng.randrange(1000)),
        ]
    )
    state = SequenceState(
        prompt_ids=prompt_ids,
        max_new_tokens=rng.randint(1, 16),
        decoder=IncrementalDecoder(TOKENIZER, TABLE),
        stop=StopMatcher([]),
        eos_id=SPECIALS.eos,
    )
    return Job(prompt_ids, state, params, logprobs=None, score_prompt=False)


def run_schedule(batch: DecodeBatch, jobs: list[Job], rng: random.Random) -> set[Job]:
    """Drive ``batch`` as the engine does, with random arrivals and cancellations.

    Returns the cancelled jobs. Checks after every step that rows stay packed at the front.
    """
    waiting, cancelled = list(jobs), set()
    while waiting or batch.members:
        if batch.members and rng.random() < 0.1:
            victim = rng.choice(batch.members)
            batch.remove([victim])
            cancelled.add(victim)
        logits = batch.decode() if batch.members else None
        lowest = 1 if logits is None and waiting else 0  # an empty batch takes someone
        arrivals = rng.randint(lowest, min(batch.free, len(waiting)))
        joining = [waiting.pop(0) for _ in range(arrivals)]
        if joining:
            new_logits = batch.prefill(joining)
            logits = new_logits if logits is None else torch.cat([logits, new_logits])
        if logits is None:
            continue
        finished = []
        for job, token in zip(batch.members, batch.sample(logits).tokens.tolist(), strict=True):
            assert job.state is not None
            job.state.append(token)
            if job.state.finished:
                finished.append(job)
        batch.remove(finished)

        assert [job.row for job in batch.members] == list(range(len(batch)))
        for job in batch.members:
            assert job.state is not None  # the last sampled token is not in the cache yet
            expected = len(job.prompt_ids) + len(job.state.generated_ids) - 1
            assert int(batch.cache.lengths[job.row]) == expected
    return cancelled


@pytest.mark.parametrize("scheme", ["rope", "learned", "alibi", "t5"])
def test_rows_joining_and_leaving_decode_as_alone(scheme: str) -> None:
    rng = random.Random(scheme)
    model = tiny_model(scheme, len(TABLE), seed=1)
    batch = DecodeBatch(model, max_rows=4, max_length=MAX_POSITIONS, vocab=len(TABLE), filler=0)
    jobs = [random_job(rng) for _ in range(12)]
    with torch.inference_mode():
        cancelled = run_schedule(batch, jobs, rng)

    assert int(batch.cache.lengths.sum()) == 0  # every row was reset when it left
    for job in jobs:
        assert job.state is not None
        alone = generate(
            model,
            TOKENIZER,
            [job.prompt_ids],
            max_new_tokens=job.state.max_new_tokens,
            sampling=job.sampler.params,
        )[0]
        got = job.state.generated_ids
        assert got == (alone.token_ids[: len(got)] if job in cancelled else alone.token_ids)


@pytest.mark.parametrize(
    ("scheme", "configured", "expected"),
    [
        ("rope", None, 4 * CONTEXT_LENGTH),
        ("rope", 1000, 1000),
        ("alibi", 50, 50),
        ("learned", None, MAX_POSITIONS),
        ("lowrank", 1000, MAX_POSITIONS),  # never past the table
        ("mds", 10, 10),
        ("binary", None, 4 * CONTEXT_LENGTH),
        ("binary", 1000, 2**8),  # 8 bits count 256 positions
    ],
)
def test_context_limit(scheme: str, configured: int | None, expected: int) -> None:
    assert context_limit(tiny_model(scheme, len(TABLE), seed=0), configured) == expected
