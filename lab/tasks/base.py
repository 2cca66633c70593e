"""What every synthetic task is: a seeded generator of token sequences and the answers to score.

A generator is a pure function of (seed, length, count): the same three numbers always give the
same tensors. ``tokens`` [N, T] holds ids of the task's own small vocabulary (no tokenizer), and
``answers`` [N, T] marks the positions whose token is an answer: the model reads tokens[:, :t]
and is scored on predicting tokens[:, t] at every marked t. Every answer can be worked out from
the tokens before it, so a perfect model scores 1.0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


class TaskError(ValueError):
    """A task was asked for something it cannot make (an unknown name, a length too short)."""


@dataclass(frozen=True)
class TaskBatch:
    """``count`` sequences of one task: tokens [N, T] (long) and answers [N, T] (bool)."""

    tokens: Tensor
    answers: Tensor


Generator = Callable[[np.random.Generator, int, int], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Task:
    """A task: its name, vocabulary size, the shortest and longest length it can fill, what it
    asks (one line, for the docs), its generator ``make(rng, length, count)`` → tokens and
    answers as numpy arrays [count, length], and whether it is ``stationary``: the first n
    tokens of a longer sequence are distributed as a sequence of n tokens, so its answers before
    and past a position see contexts of the same kind (only the positions differ)."""

    name: str
    vocab_size: int
    min_length: int
    max_length: int
    summary: str
    make: Generator
    stationary: bool

    def generate(self, seed: int, length: int, count: int) -> TaskBatch:
        """``count`` sequences of ``length`` tokens drawn with ``seed`` → TaskBatch [N, T]."""
        if not self.min_length <= length <= self.max_length:
            raise TaskError(
                f"task {self.name!r} makes sequences of {self.min_length}..{self.max_length} "
                f"tokens, not {length}"
            )
        if count < 1:
            raise TaskError(f"count must be ≥ 1, got {count}")
        tokens, answers = self.make(np.random.default_rng(seed), length, count)
        return TaskBatch(torch.from_numpy(tokens).long(), torch.from_numpy(answers).bool())


def derive_seed(*parts: int) -> int:
    """One 63-bit seed from several integers (a run's seed and a step, say), via numpy's
    SeedSequence: neighbouring inputs give unrelated streams."""
    return int(np.random.SeedSequence(list(parts)).generate_state(2, np.uint64)[0] >> np.uint64(1))
