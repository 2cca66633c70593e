"""A corpus's positional statistics: the Hellinger geometry of its positions and its noise floor.

Shared by ``ordinal train`` (the ``mds`` scheme's fixed table is P_MDS of the training split)
and ``ordinal geometry`` (the report).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lab.data import positional_token_counts
from lab.geometry.metrics import (
    hellinger_matrix,
    positional_distributions,
    split_half_noise_floor,
)


@dataclass(frozen=True)
class CorpusGeometry:
    """A corpus's positional statistics.

    sequences: [N, n] token ids, each row starting at a document boundary; entries < 0 or equal
    to pad_id are padding.  hellinger: [n, n].  noise_floor: [n] split-half floor per position.
    """

    name: str
    sequences: torch.Tensor
    vocab_size: int
    pad_id: int | None
    hellinger: np.ndarray
    noise_floor: np.ndarray

    @property
    def n_positions(self) -> int:
        return self.hellinger.shape[0]


def measure_corpus(
    name: str, sequences: torch.Tensor, vocab_size: int, pad_id: int | None, seed: int
) -> CorpusGeometry:
    """Hellinger matrix and noise floor of sequences [N, n] (see CorpusGeometry)."""
    n_positions = sequences.shape[1]
    counts, totals = positional_token_counts(sequences, n_positions, vocab_size, pad_id)
    hellinger = hellinger_matrix(positional_distributions(counts, totals))
    floor = split_half_noise_floor(sequences, n_positions, vocab_size, seed, pad_id)
    return CorpusGeometry(name, sequences, vocab_size, pad_id, hellinger, floor)
