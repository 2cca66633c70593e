"""Flip-flop language modelling (Liu et al. 2023, *Exposing Attention Glitches with Flip-Flop
Language Modeling*): remember the last written bit across ignored instructions.

A sequence is T/2 instruction–bit pairs. ``w b`` writes bit b, ``i b`` is noise to ignore, and
``r b`` reads: b must be the bit of the most recent ``w``. The first instruction is a write;
the others are ignore / write / read with the paper's FFL(0.8) probabilities 0.8 / 0.1 / 0.1.
Answers: the bit after every ``r``. Nothing but recency finds the right write, and it can be
any distance back.
"""

from __future__ import annotations

import numpy as np

from lab.tasks.base import Task

WRITE, READ, IGNORE, BIT_0, BIT_1 = range(5)
PROBABILITIES = {IGNORE: 0.8, WRITE: 0.1, READ: 0.1}


def make(rng: np.random.Generator, length: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and answers [count, length]; an odd length ends with an unanswered instruction."""
    pairs = (length + 1) // 2
    kinds = rng.choice(list(PROBABILITIES), size=(count, pairs), p=list(PROBABILITIES.values()))
    kinds[:, 0] = WRITE
    bits = rng.integers(0, 2, size=(count, pairs))
    # The index of the latest write at or before each pair: a running maximum of write indices.
    latest_write = np.maximum.accumulate(np.where(kinds == WRITE, np.arange(pairs), 0), axis=1)
    reads = kinds == READ
    bits = np.where(reads, np.take_along_axis(bits, latest_write, axis=1), bits)
    tokens = np.stack([kinds, BIT_0 + bits], axis=2).reshape(count, 2 * pairs)[:, :length]
    answers = np.stack([np.zeros_like(reads), reads], axis=2).reshape(count, 2 * pairs)
    return tokens, answers[:, :length]


TASK = Task(
    name="flipflop",
    vocab_size=5,
    min_length=2,
    max_length=1 << 20,
    summary="after `r`, the bit of the last `w` (ignoring `i`): FFL(0.8)",
    make=make,
    stationary=True,
)
