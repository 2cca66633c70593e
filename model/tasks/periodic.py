"""Associative recall with periodic distractors: one key is reassigned at a fixed period, and a
query for it must find its latest value, not the one a period (or two, or more) earlier.

The first half of a sequence of length T holds T/2 assignments, one token each (``k=v`` as in
``recall``: keys and values of 8 each). Key 0 is assigned every PERIOD tokens from a random
phase, a new value each time; the other places assign keys 1–7 at random. The rest holds
queries ``k? v``: half of them ask key 0, the others the key of a random assignment; v is the
value of its latest assignment. Answers: every v. The latest assignment of key 0 and the earlier
ones differ only by multiples of PERIOD in their distance from the query, so an encoding that
maps distances d and d + PERIOD (nearly) alike confuses them: rope's fastest pair turns 6
radians in 6 tokens, 2π − 0.28, almost a full turn. The number of distractors grows with T.
"""

from __future__ import annotations

import numpy as np

from model.tasks.base import Task
from model.tasks.recall import KEYS, QUERY_0, VALUE_0, VALUES

PERIOD = 6
REPEATED = 0  # the key assigned every PERIOD tokens


def make(rng: np.random.Generator, length: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and answers [count, length]; an odd remainder ends with an unanswered query."""
    n_assigned = length // 2
    keys = rng.integers(1, KEYS, size=(count, n_assigned))
    phase = rng.integers(0, PERIOD, size=(count, 1))
    keys[(np.arange(n_assigned) - phase) % PERIOD == 0] = REPEATED
    values = rng.integers(0, VALUES, size=(count, n_assigned))
    latest = np.zeros((count, KEYS), dtype=np.int64)  # each row's current value of each key
    for i in range(n_assigned):  # in order: a later assignment overwrites an earlier one
        latest[np.arange(count), keys[:, i]] = values[:, i]
    n_queries = (length - n_assigned + 1) // 2
    asked = np.take_along_axis(keys, rng.integers(0, n_assigned, (count, n_queries)), axis=1)
    asked = np.where(rng.random((count, n_queries)) < 0.5, REPEATED, asked)
    replies = np.take_along_axis(latest, asked, axis=1)
    queries = np.stack([QUERY_0 + asked, VALUE_0 + replies], axis=2).reshape(count, -1)
    tokens = np.concatenate([keys * VALUES + values, queries], axis=1)[:, :length]
    answers = np.zeros((count, length), dtype=bool)
    answers[:, n_assigned + 1 :: 2] = True
    return tokens, answers


TASK = Task(
    name="periodic",
    vocab_size=VALUE_0 + VALUES,
    min_length=2 * (PERIOD + 1),
    max_length=1 << 20,
    summary=f"T/2 assignments `k=v`, key 0 reassigned every {PERIOD}, then `k?`: its latest value",
    make=make,
    stationary=False,
)
