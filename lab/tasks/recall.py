"""Associative recall with overwrites: key–value assignments, then queries, each answered by
the value its key was given last.

The first quarter of a sequence of length T holds T/4 assignments, one token each (``k=v``,
keys and values drawn with replacement from 8 each, so a key is often reassigned); the rest
holds queries ``k? v``: a key that was assigned, then the value of its latest assignment.
Answers: every such value. Finding the key is content; telling its latest assignment from the
stale ones is position, at a distance that grows with T.

One token per assignment, not two (``k v``, as in Zoology's MQAR): a tiny model learns the
two-token form only through an induction head (a previous-token head composed with a matching
one), which on our budget it did not form (rope: 0.24 at L after 1,000 steps, 0.27 after
2,000; chance 0.09), while the one-token form is learned by rope, alibi and none alike. And
with overwrites, not distinct keys: with one assignment per key, the one-token form needs no
position at all (none scored 1.0 at 4L).
"""

from __future__ import annotations

import numpy as np

from lab.tasks.base import Task

KEYS = 8
VALUES = 8
QUERY_0 = KEYS * VALUES  # ids 0..63 are the assignments k=v (k·VALUES + v); 64..71 the queries k?
VALUE_0 = QUERY_0 + KEYS  # 72..79 the values


def make(rng: np.random.Generator, length: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and answers [count, length]; an odd remainder ends with an unanswered query."""
    n_assigned = length // 4
    keys = rng.integers(0, KEYS, size=(count, n_assigned))
    values = rng.integers(0, VALUES, size=(count, n_assigned))
    return assemble(keys, values, assigned_keys(rng, keys, length), length)


def assigned_keys(rng: np.random.Generator, keys: np.ndarray, length: int) -> np.ndarray:
    """The keys the queries ask [count, n_queries]: each that of a random assignment of
    ``keys`` [count, n_assigned], as many as fill the rest of ``length`` two tokens each."""
    count, n_assigned = keys.shape
    n_queries = (length - n_assigned + 1) // 2
    return np.take_along_axis(keys, rng.integers(0, n_assigned, (count, n_queries)), axis=1)


def assemble(
    keys: np.ndarray, values: np.ndarray, asked: np.ndarray, length: int
) -> tuple[np.ndarray, np.ndarray]:
    """The assignments ``keys`` = ``values`` [count, n_assigned] in order, then the queries of
    the keys ``asked`` [count, n_queries], each answered by its key's latest value, cut to
    ``length`` → tokens and answers [count, length]."""
    count, n_assigned = keys.shape
    latest = np.zeros((count, KEYS), dtype=np.int64)  # each row's current value of each key
    for i in range(n_assigned):  # in order: a later assignment overwrites an earlier one
        latest[np.arange(count), keys[:, i]] = values[:, i]
    replies = np.take_along_axis(latest, asked, axis=1)
    queries = np.stack([QUERY_0 + asked, VALUE_0 + replies], axis=2).reshape(count, -1)
    tokens = np.concatenate([keys * VALUES + values, queries], axis=1)[:, :length]
    answers = np.zeros((count, length), dtype=bool)
    answers[:, n_assigned + 1 :: 2] = True
    return tokens, answers


TASK = Task(
    name="recall",
    vocab_size=VALUE_0 + VALUES,
    min_length=4,
    max_length=1 << 20,
    summary="T/4 assignments `k=v` (keys reassigned), then queries `k?`: k's latest value",
    make=make,
    stationary=False,
)
