"""The geometry paper's synthetic corpus (section 6) and its rank–stress–parameter table.

The paper describes the corpus only as "n = 32 positions, |V| = 200, N = 5000 sequences, three
positional regimes (initial, medial, terminal), each drawing tokens from its own distribution".
The recipe below is ours; its two knobs were chosen (by a small grid search over seeds 0–2) so that
the paper's headline figures come out close — see ``PAPER_FIGURES`` and ``synthetic_figures``.

Recipe (every draw from one numpy Generator seeded with ``seed``):

1. Regimes: positions [0, n/4) are initial, [n/4, 3n/4) medial, [3n/4, n) terminal.
2. Each regime r has a Zipf distribution π_r(v) ∝ rank(v)^(−s) (s = ``zipf_exponent``) over its
   own random permutation of the vocabulary, so the three regimes favour different tokens.
3. Each position i also owns ``signature_tokens`` token ids no other position owns (a disjoint
   random choice).  μ_i = (1 − w)·π_regime(i) + w·uniform(signature tokens of i), w =
   ``signature_weight``.  This idiosyncratic part is why the positional variance is not all in
   two dimensions: it adds ~n mutually orthogonal directions of equal size (a flat eigenvalue
   tail), which is what the paper's rank-3 vs rank-16 stresses imply.
4. Every one of the N sequences has length n; the token at position i is drawn from μ_i,
   independently of the other positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lab.data import positional_token_counts
from lab.geometry.metrics import (
    GeometryInputError,
    classical_mds,
    effective_rank,
    hellinger_matrix,
    positional_distributions,
    scale_free_stress,
    split_half_noise_floor,
    stress,
    variance_captured,
)
from model.positional.sinusoidal import sinusoidal_table

REGIME_NAMES = ("initial", "medial", "terminal")
TABLE_RANKS = (1, 2, 3, 4, 8, 16, 31)

# The paper's figures for its synthetic corpus (section 5.4 and Table 3).
PAPER_FIGURES = {
    "variance_top2": 0.799,
    "variance_top3": 0.823,
    "mds_stress_rank16": 0.009,
    "sinusoidal_stress_d16": 2.248,
    "stress_ratio_d16": 241.0,
    "mds_stress_rank3": 0.047,
    "sinusoidal_stress_d128": 18.98,
}


@dataclass(frozen=True)
class SyntheticCorpus:
    """tokens: [N, n] int64 token ids.  distributions: [n, V] the true μ_i.
    regimes: [n] int64, index into REGIME_NAMES."""

    tokens: np.ndarray
    distributions: np.ndarray
    regimes: np.ndarray

    @property
    def vocab_size(self) -> int:
        return self.distributions.shape[1]

    @property
    def n_positions(self) -> int:
        return self.distributions.shape[0]


def _zipf(vocab_size: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    """A Zipf distribution over a random ordering of the vocabulary.  -> [V]"""
    weights = np.arange(1, vocab_size + 1, dtype=np.float64) ** -exponent
    return (weights / weights.sum())[rng.permutation(vocab_size)]


def synthetic_corpus(
    seed: int = 0,
    n_positions: int = 32,
    vocab_size: int = 200,
    n_sequences: int = 5000,
    zipf_exponent: float = 1.3,
    signature_weight: float = 0.12,
    signature_tokens: int = 4,
) -> SyntheticCorpus:
    """Generate the three-regime corpus described in the module docstring, reproducibly."""
    if n_positions < 4:
        raise GeometryInputError(f"n_positions must be >= 4 (three regimes), got {n_positions}")
    if n_sequences < 2:
        raise GeometryInputError(f"n_sequences must be >= 2, got {n_sequences}")
    if not 0.0 <= signature_weight <= 1.0:
        raise GeometryInputError(f"signature_weight must be in [0, 1], got {signature_weight}")
    if signature_tokens < 1 or signature_tokens * n_positions > vocab_size:
        raise GeometryInputError(
            f"signature_tokens={signature_tokens} x n_positions={n_positions} must be between "
            f"1 and vocab_size={vocab_size} (each position owns its signature tokens)"
        )
    rng = np.random.default_rng(seed)
    positions = np.arange(n_positions)
    regimes = (positions >= n_positions // 4).astype(np.int64) + (positions >= 3 * n_positions // 4)
    regime_distributions = np.stack([_zipf(vocab_size, zipf_exponent, rng) for _ in REGIME_NAMES])

    owners = rng.choice(vocab_size, size=(n_positions, signature_tokens), replace=False)
    signatures = np.zeros((n_positions, vocab_size))
    np.put_along_axis(signatures, owners, 1.0 / signature_tokens, axis=1)

    distributions = (1 - signature_weight) * regime_distributions[
        regimes
    ] + signature_weight * signatures
    tokens = np.stack(
        [rng.choice(vocab_size, size=n_sequences, p=mu) for mu in distributions], axis=1
    )
    return SyntheticCorpus(tokens=tokens, distributions=distributions, regimes=regimes)


def empirical_hellinger(corpus: SyntheticCorpus) -> np.ndarray:
    """Hellinger matrix [n, n] of the corpus's empirical positional distributions."""
    counts, totals = positional_token_counts(corpus.tokens, corpus.n_positions, corpus.vocab_size)
    return hellinger_matrix(positional_distributions(counts, totals))


@dataclass(frozen=True)
class RankStressRow:
    """One row of the rank–stress–parameter table.

    rank: columns of the positional matrix actually used (None for sinusoidal, which has d).
    parameters: trainable numbers, r(n + d) for P = A Bᵀ, n·d for a free matrix, 0 for sinusoidal.
    variance_captured: share of the positional variance in the kept eigenvalues (None if n/a).
    """

    encoding: str
    rank: int | None
    parameters: int
    stress: float
    scale_free_stress: float
    variance_captured: float | None

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def rank_stress_table(
    hellinger: np.ndarray, d_model: int = 128, ranks: Sequence[int] = TABLE_RANKS
) -> list[RankStressRow]:
    """Stress and parameter count of rank-r MDS encodings, a free n×d matrix and sinusoidal.

    hellinger: [n, n].  A rank-r encoding P = A Bᵀ with A = P_MDS (n×r) and B any d×r matrix with
    orthonormal columns has the same distances as P_MDS, hence the same stress.  A free n×d matrix
    can hold P_MDS truncated at rank min(d, n).  Ranks above the effective rank are capped by
    classical_mds, and the row reports the rank actually used.
    """
    n = hellinger.shape[0]
    eigenvalues = classical_mds(hellinger).eigenvalues
    rows = []
    for requested in ranks:
        encoding = classical_mds(hellinger, rank=min(requested, n)).positions
        rank = encoding.shape[1]
        rows.append(
            RankStressRow(
                encoding=f"mds rank {requested}",
                rank=rank,
                parameters=rank * (n + d_model),
                stress=stress(encoding, hellinger),
                scale_free_stress=scale_free_stress(encoding, hellinger),
                variance_captured=variance_captured(eigenvalues, rank),
            )
        )
    free = classical_mds(hellinger, rank=min(d_model, n)).positions
    rows.append(
        RankStressRow(
            encoding=f"free {n}x{d_model} matrix",
            rank=free.shape[1],
            parameters=n * d_model,
            stress=stress(free, hellinger),
            scale_free_stress=scale_free_stress(free, hellinger),
            variance_captured=variance_captured(eigenvalues, free.shape[1]),
        )
    )
    sinusoidal = sinusoidal_table(n, d_model)
    rows.append(
        RankStressRow(
            encoding=f"sinusoidal d={d_model}",
            rank=None,
            parameters=0,
            stress=stress(sinusoidal, hellinger),
            scale_free_stress=scale_free_stress(sinusoidal, hellinger),
            variance_captured=None,
        )
    )
    return rows


def synthetic_figures(corpus: SyntheticCorpus, noise_seed: int = 0) -> dict[str, float]:
    """The paper's headline numbers measured on `corpus` (same keys as PAPER_FIGURES), plus the
    effective rank and the split-half noise floor (mean over positions)."""
    hellinger = empirical_hellinger(corpus)
    n = corpus.n_positions
    eigenvalues = classical_mds(hellinger).eigenvalues
    mds_rank16 = stress(classical_mds(hellinger, rank=16).positions, hellinger)
    sinusoidal_d16 = stress(sinusoidal_table(n, 16), hellinger)
    floor = split_half_noise_floor(corpus.tokens, n, corpus.vocab_size, seed=noise_seed)
    return {
        "variance_top2": variance_captured(eigenvalues, 2),
        "variance_top3": variance_captured(eigenvalues, 3),
        "mds_stress_rank16": mds_rank16,
        "sinusoidal_stress_d16": sinusoidal_d16,
        "stress_ratio_d16": sinusoidal_d16 / mds_rank16,
        "mds_stress_rank3": stress(classical_mds(hellinger, rank=3).positions, hellinger),
        "sinusoidal_stress_d128": stress(sinusoidal_table(n, 128), hellinger),
        "effective_rank": float(effective_rank(eigenvalues)),
        "noise_floor_mean": float(floor.mean()),
    }
