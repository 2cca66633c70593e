"""Selective copy (Gu & Dao 2023, the Mamba paper): copy the few data tokens scattered among
blanks, in order, after a marker.

A sequence of length T is a region of T − 9 blanks in which 8 distinct data tokens (of 16) sit
at random positions, then the marker, then the 8 data tokens in the order they appeared.
Answers: those 8. Which token comes next depends on where each data token sat: its order among
the others, at distances that grow with T.
"""

from __future__ import annotations

import numpy as np

from lab.tasks.base import Task

BLANK, MARKER = 0, 1
SYMBOLS = 16  # data ids 2..17
COPIED = 8


def make(rng: np.random.Generator, length: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and answers [count, length]."""
    region = length - COPIED - 1
    data = 2 + rng.random((count, SYMBOLS)).argsort(axis=1)[:, :COPIED]  # distinct per row
    slots = np.sort(rng.random((count, region)).argsort(axis=1)[:, :COPIED], axis=1)
    tokens = np.full((count, length), BLANK)
    np.put_along_axis(tokens, slots, data, axis=1)
    tokens[:, region] = MARKER
    tokens[:, region + 1 :] = data
    answers = np.zeros((count, length), dtype=bool)
    answers[:, region + 1 :] = True
    return tokens, answers


TASK = Task(
    name="copy",
    vocab_size=2 + SYMBOLS,
    min_length=2 * COPIED + 1,
    max_length=1 << 20,
    summary=f"{COPIED} data tokens among blanks, then a marker: copy them in order",
    make=make,
    stationary=False,
)
