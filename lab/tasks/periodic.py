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

from lab.tasks.base import Task
from lab.tasks.recall import KEYS, VALUE_0, VALUES, assemble, assigned_keys

PERIOD = 6
REPEATED = 0  # the key assigned every PERIOD tokens


def make(rng: np.random.Generator, length: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and answers [count, length]; an odd remainder ends with an unanswered query."""
    n_assigned = length // 2
    keys = rng.integers(1, KEYS, size=(count, n_assigned))
    phase = rng.integers(0, PERIOD, size=(count, 1))
    keys[(np.arange(n_assigned) - phase) % PERIOD == 0] = REPEATED
    values = rng.integers(0, VALUES, size=(count, n_assigned))
    asked = assigned_keys(rng, keys, length)
    asked = np.where(rng.random(asked.shape) < 0.5, REPEATED, asked)
    return assemble(keys, values, asked, length)


TASK = Task(
    name="periodic",
    vocab_size=VALUE_0 + VALUES,
    min_length=2 * (PERIOD + 1),
    max_length=1 << 20,
    summary=f"T/2 assignments `k=v`, key 0 reassigned every {PERIOD}, then `k?`: its latest value",
    make=make,
    stationary=False,
)
