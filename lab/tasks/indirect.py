"""Indirect indexing (as PoPE's paper tests it): find a token by its content, then answer the
token a given offset away from it.

The first T − 8 tokens are distinct items (a random sample of 256). Then two queries
``? s o t`` each name a source item s of that sequence and an offset o in ±1..±3, and t is the
item o places from s. Answers: each t. The source is found by what it is; the answer by where
it is relative to it: content and position, composed, at any depth.
"""

from __future__ import annotations

import numpy as np

from lab.tasks.base import Task

ITEMS = 256
MARKER = ITEMS  # ?
OFFSETS = (-3, -2, -1, 1, 2, 3)
OFFSET_0 = MARKER + 1  # OFFSET_0 + i: the offset OFFSETS[i]
QUERIES = 2
REACH = max(map(abs, OFFSETS))


def make(rng: np.random.Generator, length: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and answers [count, length]; lengths past ITEMS + 8 are refused (the items of a
    sequence are distinct)."""
    body = length - 4 * QUERIES
    tokens = np.zeros((count, length), dtype=np.int64)
    answers = np.zeros((count, length), dtype=bool)
    for row in range(count):
        items = rng.permutation(ITEMS)[:body]
        tokens[row, :body] = items
        for query in range(QUERIES):
            offset = rng.integers(len(OFFSETS))
            shift = OFFSETS[offset]
            low, high = max(0, -shift), min(body, body - shift)  # source and target inside
            source = rng.integers(low, high)
            at = body + 4 * query
            tokens[row, at : at + 4] = [
                MARKER,
                items[source],
                OFFSET_0 + offset,
                items[source + shift],
            ]
            answers[row, at + 3] = True
    return tokens, answers


TASK = Task(
    name="indirect",
    vocab_size=OFFSET_0 + len(OFFSETS),
    min_length=4 * QUERIES + REACH + 1,
    max_length=ITEMS + 4 * QUERIES,
    summary="distinct items, then `? s o`: the item o places (±1..3) from item s",
    make=make,
    stationary=False,
)
