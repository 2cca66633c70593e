"""Counting since a marker (after the counting tasks of Golovneva et al. 2024, *Contextual
Position Encoding*): how many times a letter appeared since the last marker.

A sequence is segments ``| x x … x ? s n``: the marker, 4–12 letters of four, the query token,
a letter s, and n, the number of times s occurs in the segment (0–12). Segments follow each
other to the end of the sequence; one that does not fit is cut off unanswered. Answers: every
n. Counting needs the marker's position, not a fixed distance: segments vary in length.
"""

from __future__ import annotations

import numpy as np

from lab.tasks.base import Task

LETTERS = 4  # ids 0..3
MARKER, QUERY = 4, 5
COUNT_0 = 6  # ids 6..18 are the counts 0..12
SHORTEST, LONGEST = 4, 12  # letters per segment


def _segment(rng: np.random.Generator) -> tuple[list[int], int]:
    """One whole segment's tokens and the index of its answer in them."""
    letters = rng.integers(0, LETTERS, size=rng.integers(SHORTEST, LONGEST + 1))
    asked = int(rng.integers(0, LETTERS))
    answer = COUNT_0 + int((letters == asked).sum())
    return [MARKER, *letters.tolist(), QUERY, asked, answer], len(letters) + 3


def _row(rng: np.random.Generator, length: int) -> tuple[list[int], list[int]]:
    """One sequence's tokens and answer positions."""
    tokens: list[int] = []
    answers: list[int] = []
    while len(tokens) < length:
        segment, answer = _segment(rng)
        if len(tokens) + answer < length:
            answers.append(len(tokens) + answer)
        tokens += segment
    return tokens[:length], answers


def make(rng: np.random.Generator, length: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and answers [count, length]."""
    tokens = np.zeros((count, length), dtype=np.int64)
    answers = np.zeros((count, length), dtype=bool)
    for row in range(count):
        row_tokens, row_answers = _row(rng, length)
        tokens[row] = row_tokens
        answers[row, row_answers] = True
    return tokens, answers


TASK = Task(
    name="counting",
    vocab_size=COUNT_0 + LONGEST + 1,
    min_length=1,
    max_length=1 << 20,
    summary="segments `| letters ? s n`: n = how often s appeared since the marker",
    make=make,
    stationary=True,
)
