"""Positional statistics, the Hellinger metric, classical MDS and encoding diagnostics.

Everything here is the exact math of REFERENCE.md ("Positional statistics", "Classical MDS",
"Diagnostics of an encoding P").  Matrices are small (n <= 512 positions), so the work is done in
numpy float64; inputs may be numpy arrays, nested lists or torch tensors.

Notation: n positions, V vocabulary size, d encoding width.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from lab.data import positional_token_counts

MAX_SMOOTHING = 1e-3
# Eigenvalues below this fraction of the largest are numerical zeros (REFERENCE.md).
EFFECTIVE_RANK_TOLERANCE = 1e-9
# How many anchor positions the monotonicity count processes at once: bounds the n x n boolean
# comparison blocks to about 8 * n^2 bytes each, i.e. 2 MB at n = 512.
_MONOTONICITY_CHUNK = 8


class GeometryInputError(ValueError):
    """An argument to a geometry function has the wrong shape, range or type."""


class MDSResult(NamedTuple):
    """Classical MDS output.

    positions: [n, r] float64, rows are the embedded points (P_MDS = U_r Λ_r^{1/2}).
    eigenvalues: [n] float64, every eigenvalue of the double-centred matrix B, descending
        (the trailing ones are ~0 or slightly negative for a Euclidean distance matrix).
    """

    positions: np.ndarray
    eigenvalues: np.ndarray


def as_float_matrix(values: object, name: str) -> np.ndarray:
    """Convert an array-like or tensor to a finite 2-D float64 numpy array, or raise."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().to(torch.float64).numpy()
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 2:
        raise GeometryInputError(f"{name} must be 2-D, got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise GeometryInputError(f"{name} contains NaN or infinite values")
    return array


# --------------------------------------------------------------------------- positional statistics


def positional_distributions(
    counts: object, n_i: object | None = None, epsilon: float = 0.0
) -> np.ndarray:
    """Token distribution μ_i at every position: counts / N_i, optionally with additive smoothing.

    counts: [n, V] non-negative token counts per position.
    n_i: [n] number of sequences reaching each position; it must equal the row sums (a mismatch
        means padding or missing tokens were counted).  Defaults to the row sums.
    epsilon: pseudo-count added to every cell, 0 <= epsilon <= 1e-3 (larger smoothing, e.g.
        add-one, distorts Hellinger distances by tens of percent).
    Returns mu [n, V] float64, rows summing to 1.
    """
    counts = as_float_matrix(counts, "counts")
    if np.any(counts < 0):
        raise GeometryInputError("counts must be non-negative")
    row_sums = counts.sum(axis=1)
    totals = row_sums if n_i is None else np.asarray(n_i, dtype=np.float64).reshape(-1)
    if totals.shape != row_sums.shape:
        raise GeometryInputError(f"n_i has shape {totals.shape}, expected {row_sums.shape}")
    if not np.allclose(totals, row_sums):
        bad = int(np.argmax(~np.isclose(totals, row_sums)))
        raise GeometryInputError(
            f"n_i[{bad}] = {totals[bad]} but position {bad} has {row_sums[bad]} counted tokens"
        )
    if np.any(totals <= 0):
        raise GeometryInputError(f"position {int(np.argmin(totals))} has no tokens (N_i = 0)")
    if not 0.0 <= epsilon <= MAX_SMOOTHING:
        raise GeometryInputError(f"epsilon must be in [0, {MAX_SMOOTHING}], got {epsilon}")
    vocab_size = counts.shape[1]
    return (counts + epsilon) / (totals[:, None] + epsilon * vocab_size)


def pairwise_distances(points: object) -> np.ndarray:
    """Euclidean distance between every pair of rows.  points: [n, d] -> [n, n] float64.

    Uses direct differences rather than the |a|^2 + |b|^2 - 2ab expansion so that tiny distances
    (close positions, noise floors) are not lost to cancellation.
    """
    matrix = torch.from_numpy(as_float_matrix(points, "points"))
    return torch.cdist(matrix, matrix, compute_mode="donot_use_mm_for_euclid_dist").numpy()


def _check_distributions(mu: np.ndarray, name: str) -> None:
    if np.any(mu < 0) or not np.allclose(mu.sum(axis=1), 1.0, atol=1e-6):
        raise GeometryInputError(f"{name} rows must be probability distributions (>= 0, sum 1)")


def hellinger_matrix(mu: object) -> np.ndarray:
    """Hellinger distance d_H(μ_i, μ_j) = ‖√μ_i − √μ_j‖₂ for every pair of positions.

    mu: [n, V] rows are distributions.  Returns [n, n] float64, symmetric, zero diagonal,
    entries in [0, √2].
    """
    mu = as_float_matrix(mu, "mu")
    _check_distributions(mu, "mu")
    return pairwise_distances(np.sqrt(mu))


def noise_floor(counts_a: object, counts_b: object) -> np.ndarray:
    """Per-position Hellinger distance between two independent estimates of the same μ_i.

    counts_a, counts_b: [n, V] token counts per position from two disjoint sets of sequences.
    Returns [n] float64.  Distances between positions below this floor are not resolvable.
    """
    mu_a = positional_distributions(counts_a)
    mu_b = positional_distributions(counts_b)
    if mu_a.shape != mu_b.shape:
        raise GeometryInputError(f"count matrices differ in shape: {mu_a.shape} vs {mu_b.shape}")
    return np.linalg.norm(np.sqrt(mu_a) - np.sqrt(mu_b), axis=1)


def split_half_noise_floor(
    sequences: Sequence[Sequence[int]] | np.ndarray | torch.Tensor,
    n_positions: int,
    vocab_size: int,
    seed: int = 0,
    pad_id: int | None = None,
) -> np.ndarray:
    """Split-half sampling-noise floor: shuffle the sequences with `seed`, split them into two
    halves, and return the Hellinger distance between each position's two estimates, [n].

    sequences: N sequences starting at document boundaries, in any form
        ``lab.data.positional_token_counts`` accepts (a padded [N, L] matrix whose negative
        entries are padding, or a list of 1-D sequences of any lengths); `pad_id` entries are
        padding too.

    Each half holds N/2 sequences, so this floor is about √2 times the noise between two
    full-corpus estimates: a deliberately conservative yardstick.
    """
    if len(sequences) < 2:
        raise GeometryInputError(f"need at least 2 sequences to split, got {len(sequences)}")
    order = np.random.default_rng(seed).permutation(len(sequences))
    half = len(sequences) // 2
    first: Sequence[Sequence[int]] | np.ndarray | torch.Tensor  # as `sequences`
    second: Sequence[Sequence[int]] | np.ndarray | torch.Tensor
    if isinstance(sequences, np.ndarray | torch.Tensor):  # a padded [N, L] matrix
        first, second = sequences[order[:half]], sequences[order[half:]]
    else:
        first = [sequences[i] for i in order[:half]]
        second = [sequences[i] for i in order[half:]]
    counts_a, _ = positional_token_counts(first, n_positions, vocab_size, pad_id)
    counts_b, _ = positional_token_counts(second, n_positions, vocab_size, pad_id)
    return noise_floor(counts_a, counts_b)


# ------------------------------------------------------------------------------- classical MDS


def _check_distance_matrix(distances: np.ndarray) -> None:
    n_rows, n_cols = distances.shape
    if n_rows != n_cols:
        raise GeometryInputError(f"distance matrix must be square, got {distances.shape}")
    if np.any(distances < 0):
        raise GeometryInputError("distance matrix has negative entries")
    scale = max(float(np.abs(distances).max()), 1.0)
    if not np.allclose(distances, distances.T, atol=1e-9 * scale):
        raise GeometryInputError("distance matrix is not symmetric")
    if np.any(np.abs(np.diag(distances)) > 1e-9 * scale):
        raise GeometryInputError("distance matrix has a non-zero diagonal")


def classical_mds(distances: object, rank: int | None = None) -> MDSResult:
    """Torgerson classical MDS of a distance matrix.

    distances: [n, n] symmetric, zero diagonal.  B = −½ J D² J with J = I − 11ᵀ/n; the embedding
    keeps the top `rank` positive eigenpairs: P = U_r Λ_r^{1/2}.  rank=None keeps every eigenvalue
    above the effective-rank tolerance; a rank larger than that is capped at the effective rank
    (further columns would be zero).  Each eigenvector's sign is fixed so that its largest-magnitude
    entry is positive, making the result reproducible.
    Returns MDSResult(positions [n, r], eigenvalues [n] descending).
    """
    distances = as_float_matrix(distances, "distances")
    _check_distance_matrix(distances)
    n = distances.shape[0]
    if rank is not None and not 1 <= rank <= n:
        raise GeometryInputError(f"rank must be between 1 and n={n}, got {rank}")
    centering = np.eye(n) - np.full((n, n), 1.0 / n)
    gram = -0.5 * centering @ (distances**2) @ centering
    eigenvalues, eigenvectors = np.linalg.eigh((gram + gram.T) / 2)  # ascending
    eigenvalues, eigenvectors = eigenvalues[::-1], eigenvectors[:, ::-1]
    keep = effective_rank(eigenvalues)
    if rank is not None:
        keep = min(keep, rank)
    vectors = eigenvectors[:, :keep]
    largest = vectors[np.argmax(np.abs(vectors), axis=0), np.arange(keep)]
    vectors = vectors * np.where(largest < 0, -1.0, 1.0)
    return MDSResult(positions=vectors * np.sqrt(eigenvalues[:keep]), eigenvalues=eigenvalues)


def effective_rank(eigenvalues: object) -> int:
    """Number of eigenvalues above 1e-9 times the largest one.  eigenvalues: [n]."""
    values = np.asarray(eigenvalues, dtype=np.float64).reshape(-1)
    if values.size == 0 or values.max() <= 0:
        return 0
    return int(np.sum(values > EFFECTIVE_RANK_TOLERANCE * values.max()))


def variance_captured(eigenvalues: object, k: int) -> float:
    """Fraction of the positional variance carried by the top k eigenvalues: Σ_{≤k} λ / Σ λ,
    summing positive eigenvalues only (the negative ones are numerical noise or curvature)."""
    values = np.sort(np.asarray(eigenvalues, dtype=np.float64).reshape(-1))[::-1]
    if k < 0:
        raise GeometryInputError(f"k must be >= 0, got {k}")
    positive = np.clip(values, 0.0, None)
    total = positive.sum()
    if total <= 0:
        raise GeometryInputError("no positive eigenvalues: all points coincide")
    return float(positive[:k].sum() / total)


# ------------------------------------------------------------------------ diagnostics of P


def _upper_pairs(encoding: object, hellinger: object) -> tuple[np.ndarray, np.ndarray]:
    """Encoding distances and Hellinger distances over pairs i < j, each [n(n−1)/2]."""
    distances = pairwise_distances(encoding)
    target = as_float_matrix(hellinger, "hellinger")
    if target.shape != distances.shape:
        raise GeometryInputError(
            f"encoding has {distances.shape[0]} positions but the Hellinger matrix is "
            f"{target.shape}"
        )
    if distances.shape[0] < 2:
        raise GeometryInputError("need at least 2 positions")
    rows, cols = np.triu_indices(distances.shape[0], k=1)
    return distances[rows, cols], target[rows, cols]


def stress(encoding: object, hellinger: object) -> float:
    """Raw stress: mean over pairs i<j of (‖p_i − p_j‖ − H_ij)².

    encoding: [n, d] rows p_i.  hellinger: [n, n] target distances."""
    distances, target = _upper_pairs(encoding, hellinger)
    return float(np.mean((distances - target) ** 2))


def _best_scale(distances: np.ndarray, target: np.ndarray) -> float:
    norm = float(np.sum(distances**2))
    return float(np.sum(distances * target) / norm) if norm > 0 else 0.0


def optimal_scale(encoding: object, hellinger: object) -> float:
    """s* = Σ D_ij H_ij / Σ D_ij², the scale minimising stress(s·P).  0 if all points coincide."""
    return _best_scale(*_upper_pairs(encoding, hellinger))


def scale_free_stress(encoding: object, hellinger: object) -> float:
    """min over s > 0 of stress(s·P): the stress left once the overall scale is matched."""
    distances, target = _upper_pairs(encoding, hellinger)
    scale = _best_scale(distances, target)
    return float(np.mean((scale * distances - target) ** 2))


def monotonicity_violation_rate(encoding: object) -> float:
    """Fraction of triples (i, j, k), distinct, with |i−j| < |i−k| but ‖p_i−p_j‖ > ‖p_i−p_k‖.

    Exact count over all ~n³ triples, vectorised over blocks of anchors i.  encoding: [n, d],
    n >= 3.  About 0.5 for a random matrix, 0 for a perfectly monotone encoding.
    """
    distances = pairwise_distances(encoding)
    n = distances.shape[0]
    if n < 3:
        raise GeometryInputError(f"need at least 3 positions for triples, got {n}")
    offsets = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    violations = 0
    comparable = 0
    for start in range(0, n, _MONOTONICITY_CHUNK):
        rows = slice(start, start + _MONOTONICITY_CHUNK)
        offset, dist = offsets[rows], distances[rows]
        # closer[a, j, k]: j is strictly closer in sequence to anchor a than k is, and j != a.
        closer = (offset[:, :, None] < offset[:, None, :]) & (offset[:, :, None] > 0)
        farther_in_space = dist[:, :, None] > dist[:, None, :]
        comparable += int(closer.sum())
        violations += int((closer & farther_in_space).sum())
    return violations / comparable


def min_separation(encoding: object) -> float:
    """min over i ≠ j of ‖p_i − p_j‖.  encoding: [n, d], n >= 2."""
    distances = pairwise_distances(encoding)
    if distances.shape[0] < 2:
        raise GeometryInputError("need at least 2 positions")
    np.fill_diagonal(distances, np.inf)
    return float(distances.min())
