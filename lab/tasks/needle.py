"""A multi-key needle in a haystack (RULER's MK-NIAH, on a tiny vocabulary): find one key's
value among distractor needles and filler, at any depth.

The first T − 4 tokens are filler, with a needle every 8 tokens or so at random places: each a
single token ``k=v`` (keys distinct within a sequence, so no needle overwrites another; one
token, as recall's assignments are, so that no induction head is needed). Then two queries
``k? v`` ask two of the needles' keys. Answers: the two values. Finding the needle is content;
what the length tests is whether attention still finds it when the haystack is longer and
holds more distractors than any training sequence did.
"""

from __future__ import annotations

import numpy as np

from lab.tasks.base import Task

FILLERS = 8
KEYS = 16
VALUES = 8
NEEDLE_0 = FILLERS  # FILLERS + k·VALUES + v: the needle k=v
QUERY_0 = NEEDLE_0 + KEYS * VALUES  # QUERY_0 + k: the query k?
VALUE_0 = QUERY_0 + KEYS  # VALUE_0 + v: an answer
QUERIES = 2
SPACING = 8  # a needle per this many haystack tokens (at least QUERIES, at most KEYS)


def make(rng: np.random.Generator, length: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and answers [count, length]."""
    haystack = length - 2 * QUERIES
    needles = min(KEYS, haystack, max(QUERIES, haystack // SPACING))
    tokens = rng.integers(0, FILLERS, size=(count, length))
    answers = np.zeros((count, length), dtype=bool)
    for row in range(count):
        keys = rng.permutation(KEYS)[:needles]
        values = rng.integers(0, VALUES, size=needles)
        places = np.sort(rng.choice(haystack, size=needles, replace=False))
        tokens[row, places] = NEEDLE_0 + keys * VALUES + values
        asked = rng.choice(needles, size=QUERIES, replace=False)
        for query, needle in enumerate(asked):
            at = haystack + 2 * query
            tokens[row, at] = QUERY_0 + keys[needle]
            tokens[row, at + 1] = VALUE_0 + values[needle]
            answers[row, at + 1] = True
    return tokens, answers


TASK = Task(
    name="needle",
    vocab_size=VALUE_0 + VALUES,
    min_length=2 * QUERIES + QUERIES,
    max_length=1 << 20,
    summary="filler with a needle `k=v` every ~8 tokens (distinct keys), then queries `k?`: "
    "k's value",
    make=make,
    stationary=False,
)
