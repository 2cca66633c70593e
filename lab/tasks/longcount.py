"""Counting over segments that grow with the sequence (after the selective counting of
Golovneva et al. 2024, *Contextual Position Encoding*): how many times a letter appeared since
the last marker, when the letters sit among blanks that fill the whole sequence.

A sequence of length T is two segments ``| … ? s n``, each about T/2 tokens: the marker, a
region of blanks in which 1–8 letters (of four) sit at random places, the query token, a letter
s, and n, the number of times s occurs in the region (0–8). Answers: both n. The letters, the
counts and the number of answers are distributed alike at every length from T = 24 on (below, a
region of fewer than 8 tokens caps the letters); only the spans grow, in proportion to T. So
the count is always over a handful of letters, but the marker it starts from lies T/2 tokens
back: an encoding that counts tokens meets distances it never trained on, one that counts the
letters themselves (CoPE) does not. This is the case ``counting`` (segments of 4–12 letters
whatever T) leaves open.
"""

from __future__ import annotations

import numpy as np

from lab.tasks.base import Task
from lab.tasks.counting import COUNT_0, LETTERS, MARKER, QUERY

MOST = 8  # letters per segment: 1..MOST
BLANK = COUNT_0 + MOST + 1  # the filler between the letters
SEGMENTS = 2
FRAME = 4  # a segment's tokens besides its region: the marker, ? s n


def _segment(rng: np.random.Generator, size: int) -> tuple[list[int], int]:
    """One segment of ``size`` tokens and the index of its answer in them."""
    region = size - FRAME
    letters = rng.integers(0, LETTERS, size=rng.integers(1, min(MOST, region) + 1))
    tokens = np.full(region, BLANK)
    tokens[np.sort(rng.permutation(region)[: len(letters)])] = letters
    asked = int(rng.integers(0, LETTERS))
    answer = COUNT_0 + int((letters == asked).sum())
    return [MARKER, *tokens.tolist(), QUERY, asked, answer], size - 1


def make(rng: np.random.Generator, length: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and answers [count, length]: the first segment has T // 2 tokens, the second the
    rest."""
    tokens = np.zeros((count, length), dtype=np.int64)
    answers = np.zeros((count, length), dtype=bool)
    for row in range(count):
        start = 0
        for size in (length // SEGMENTS, length - length // SEGMENTS):
            segment, answer = _segment(rng, size)
            tokens[row, start : start + size] = segment
            answers[row, start + answer] = True
            start += size
    return tokens, answers


TASK = Task(
    name="longcount",
    vocab_size=BLANK + 1,
    min_length=SEGMENTS * (FRAME + 1),
    max_length=1 << 20,
    summary="two segments of T/2 `| blanks and letters ? s n`: n = how often s appeared since |",
    make=make,
    stationary=False,
)
