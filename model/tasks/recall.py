"""Multi-query associative recall (Zoology's MQAR; Ba et al. 2016): key–value pairs, then
queries, each answered by the value its key was paired with.

The first half of a sequence of length T holds T/4 pairs ``k v`` with distinct keys; the second
half holds queries ``k v``: a key drawn from the pairs, then its value. Answers: the value of
every query. Finding it takes two positional steps: the earlier occurrence of the key (content),
then the token right after it (distance one), at any distance back.
"""

from __future__ import annotations

import numpy as np

from model.tasks.base import Task

KEYS = 64  # ids 0..63; a sequence uses up to T/4 of them, distinct
VALUES = 16  # ids 64..79


def make(rng: np.random.Generator, length: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and answers [count, length]; an odd length ends with an unanswered query key."""
    n_pairs = length // 4
    n_queries = (length - 2 * n_pairs + 1) // 2
    keys = rng.random((count, KEYS)).argsort(axis=1)[:, :n_pairs]  # distinct keys per row
    values = KEYS + rng.integers(0, VALUES, size=(count, n_pairs))
    asked = rng.integers(0, n_pairs, size=(count, n_queries))
    query_keys = np.take_along_axis(keys, asked, axis=1)
    query_values = np.take_along_axis(values, asked, axis=1)
    pairs = np.stack([keys, values], axis=2).reshape(count, -1)
    queries = np.stack([query_keys, query_values], axis=2).reshape(count, -1)
    tokens = np.concatenate([pairs, queries], axis=1)[:, :length]
    answers = np.zeros((count, length), dtype=bool)
    answers[:, 2 * n_pairs + 1 :: 2] = True
    return tokens, answers


TASK = Task(
    name="recall",
    vocab_size=KEYS + VALUES,
    min_length=4,
    max_length=4 * KEYS + 3,
    summary="T/4 key–value pairs, then queries: each key's value",
    make=make,
)
