"""The five requirements of a positional encoding (seed 000), measured as numbers.

Each requirement is a measurement on the scheme's representation (lab.geometry.representations)
over positions 0..n−1, turned into a verdict by a threshold named below (REFERENCE.md, "The five
requirements, measured").  Nothing is looked up from a table of known answers: whether a scheme can
go past its ``max_positions`` is found by asking it for positions and catching
PositionOutOfRange.  A verdict is None when it cannot be measured (no signal to measure, or the
scheme cannot reach the positions the measurement needs).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lab.geometry.metrics import min_separation, pairwise_distances
from lab.geometry.representations import encode_positions, position_vectors
from model.config import ModelConfig
from model.positional import SCHEMES, PositionalScheme, PositionOutOfRange, build_scheme

# bounded: the largest position vector (Euclidean norm; REFERENCE.md's "max |PE|") over positions
# 0..4n−1 may exceed the largest over 0..n−1 by at most this factor.  Norms rather than single
# entries, so that the extreme-value drift of a random table (a few %) stays far below the limit.
BOUNDED_GROWTH_LIMIT = 1.5
# unique: the closest two positions are farther apart than this fraction of the farthest two.
UNIQUE_TOLERANCE = 1e-6
# length-independent: a position's vector moves by at most this fraction of max |PE| when it is
# computed in a sequence twice as long.
LENGTH_TOLERANCE = 1e-6
# smooth: no step between neighbours is longer than this fraction of the median distance.  A
# random table sits at ~1.1 and binary at ~1.4 (7 → 8 flips four bits); sinusoidal and rope at
# 0.25–0.6 (rope is near the top of that range only with tiny heads, where its 1 rad/token
# frequency dominates).
SMOOTHNESS_LIMIT = 0.75
# relative distance recoverable: what the scheme puts into the score of query i and key j (see
# score_terms) varies along every diagonal i − j = const (std) by at most this fraction of its
# mean magnitude; float32 tables and rotations reach ~1e-7.
RELATIVE_TOLERANCE = 1e-4
# The largest position probed when looking for a scheme's limit.
PROBE_CEILING = 2**20


@dataclass(frozen=True)
class RequirementRow:
    """The measurements of one scheme over positions 0..n−1 and the verdicts they give.

    bounded_growth: max ‖PE(p)‖ over 0..4n−1 divided by that over 0..n−1 (None if the scheme
        cannot represent position 4n−1).
    length_drift: max |PE_n(p) − PE_2n(p)| / max |PE| over p < n (the same position computed in
        sequences of length n and 2n).
    smoothness: max_p ‖PE(p+1) − PE(p)‖ / median pairwise distance.
    relative_error: max over diagonals i − j = const of the spread of each score term (std / mean
        magnitude; see score_terms), 0 when every way the scheme acts sees i − j alone.
    position_limit: the first position the scheme refuses (None: none up to PROBE_CEILING).
    """

    scheme: str
    n_positions: int
    width: int
    bounded_growth: float | None
    min_separation: float
    length_drift: float
    smoothness: float
    relative_error: float
    position_limit: int | None
    bounded: bool | None
    unique: bool
    length_independent: bool
    smooth: bool | None
    relative_recoverable: bool | None
    beyond_max_positions: bool

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: NaN measurements become None."""
        return {
            key: None if isinstance(value, float) and math.isnan(value) else value
            for key, value in dataclasses.asdict(self).items()
        }


def first_refused_position(scheme: PositionalScheme, ceiling: int = PROBE_CEILING) -> int | None:
    """Smallest position the scheme refuses with PositionOutOfRange, or None up to `ceiling`.

    Probes positions 0, 1, 2, 4, … then bisects between the last accepted and first refused one
    (tables refuse every position from their end onwards).
    """

    def accepted(position: int) -> bool:
        try:
            encode_positions(scheme, torch.tensor([position]), torch.arange(1))
        except PositionOutOfRange:
            return False
        return True

    if not accepted(0):
        return 0
    low, high = 0, 1
    while accepted(high):
        if high >= ceiling:
            return None
        low, high = high, min(2 * high, ceiling)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if accepted(middle) else (low, middle)
    return high


def _largest_norm(vectors: Tensor) -> float:
    return torch.linalg.vector_norm(vectors, dim=1).max().item()


def bounded_growth(scheme: PositionalScheme, n_positions: int) -> float | None:
    """Largest ‖PE(p)‖ over positions 0..4n−1 divided by that over 0..n−1 (None if position
    4n−1 is refused).  About 1 for a bounded scheme, about 4 for one growing linearly in p.
    Bias rows are always taken against keys 0..n−1, so every vector has the same width."""
    try:
        long_peak = _largest_norm(position_vectors(scheme, 4 * n_positions, n_positions))
    except PositionOutOfRange:
        return None
    short_peak = _largest_norm(position_vectors(scheme, n_positions))
    if short_peak == 0:
        return 1.0 if long_peak == 0 else math.inf
    return long_peak / short_peak


def length_drift(scheme: PositionalScheme, n_positions: int) -> float:
    """How much positions 0..n−1 move when computed in a sequence of length 2n instead of n,
    relative to the largest entry (0 for a length-independent scheme)."""
    keys = torch.arange(n_positions)
    short = encode_positions(scheme, torch.arange(n_positions), keys)
    if short is None:
        return 0.0
    try:
        long = encode_positions(scheme, torch.arange(2 * n_positions), keys)
    except PositionOutOfRange:
        long = encode_positions(scheme, torch.arange(n_positions), keys)
    assert long is not None  # the scheme encoded the short sequence
    long = long[:n_positions]
    peak = short.abs().max().item()
    drift = (short - long).abs().max().item()
    return drift / peak if peak > 0 else drift


def smoothness(vectors: Tensor) -> float:
    """max_p ‖PE(p+1) − PE(p)‖ / median pairwise distance.  vectors: [n, w], n >= 2."""
    distances = pairwise_distances(vectors)
    steps = np.diagonal(distances, offset=1)
    median = np.median(distances[np.triu_indices(len(distances), k=1)])
    return float(steps.max() / median) if median > 0 else math.nan


def score_terms(scheme: PositionalScheme, n_positions: int, seed: int = 0) -> list[Tensor]:
    """What the scheme adds to the attention score of query i and key j, for i, j in 0..n−1, one
    term per way it acts → each [heads, n, n] float64 (an empty list for ``none``):

    - added vector: PE_i·PE_j (one "head"). It depends on i − j alone exactly when one
      orthogonal shift map M_k takes every PE(p) to PE(p + k), as sinusoidal's rotations do
      (equal Gram diagonals make p ↦ p + k an isometry). A merely linear M_k would prove
      nothing: n ≤ d independent vectors (any random table) always admit one.
    - rotation: R(i)q · R(j)k for a fixed random q and k per head (``seed``); for rope this is
      q · R(j − i)k, a function of i − j.
    - score bias: the bias itself (alibi and t5 build it from i − j).
    """
    positions = torch.arange(n_positions).unsqueeze(0)
    terms = []
    with torch.no_grad():
        embedding = scheme.embedding(positions)
        if embedding is not None:
            vectors = embedding[0].double()
            terms.append((vectors @ vectors.T).unsqueeze(0))
        if scheme.rotation(positions) is not None:
            config = scheme.config
            generator = torch.Generator().manual_seed(seed)
            q, k = torch.randn(2, 1, config.n_heads, 1, config.head_dim, generator=generator)
            shape = (1, config.n_heads, n_positions, config.head_dim)
            rotated_q = scheme.rotate(q.expand(shape), positions)[0].double()
            rotated_k = scheme.rotate(k.expand(shape), positions)[0].double()
            terms.append(rotated_q @ rotated_k.transpose(1, 2))
        bias = scheme.attention_bias(positions, positions[0])
        if bias is not None:
            terms.append(bias[0].double())
    return [term.cpu() for term in terms]


def diagonal_spread(term: Tensor) -> float:
    """max over offsets d ≥ 0 and heads of std_i term[h, i + d, i], over the mean |term| of the
    pairs a causal model scores (query at or after key). term: [heads, n, n]; NaN if all 0."""
    matrices = term.numpy()
    rows, columns = np.tril_indices(matrices.shape[-1])
    scale = np.abs(matrices[:, rows, columns]).mean()
    if scale == 0:
        return math.nan
    spread = max(
        np.diagonal(matrices, offset=-offset, axis1=1, axis2=2).std(axis=-1).max()
        for offset in range(matrices.shape[-1])
    )
    return float(spread / scale)


def relative_error(scheme: PositionalScheme, n_positions: int) -> float:
    """The largest diagonal spread of the scheme's score terms over positions 0..n−1: 0 when
    every way it acts sees only i − j (relative distance recoverable), NaN when it adds nothing
    to any score."""
    spreads = [diagonal_spread(term) for term in score_terms(scheme, n_positions)]
    measured = [spread for spread in spreads if not math.isnan(spread)]
    return max(measured) if measured else math.nan


def measure_requirements(scheme: PositionalScheme, n_positions: int) -> RequirementRow:
    """Measure the five requirements (and the position limit) of one scheme over 0..n−1."""
    if n_positions < 3:
        raise ValueError(f"n_positions must be >= 3, got {n_positions}")
    vectors = position_vectors(scheme, n_positions)
    growth = bounded_growth(scheme, n_positions)
    separation = min_separation(vectors)
    widest = float(pairwise_distances(vectors).max())
    drift = length_drift(scheme, n_positions)
    smooth_ratio = smoothness(vectors)
    relative = relative_error(scheme, n_positions)
    limit = first_refused_position(scheme)
    return RequirementRow(
        scheme=scheme.name,
        n_positions=n_positions,
        width=vectors.shape[1],
        bounded_growth=growth,
        min_separation=separation,
        length_drift=drift,
        smoothness=smooth_ratio,
        relative_error=relative,
        position_limit=limit,
        bounded=None if growth is None else growth <= BOUNDED_GROWTH_LIMIT,
        unique=separation > UNIQUE_TOLERANCE * widest,
        length_independent=drift <= LENGTH_TOLERANCE,
        smooth=None if math.isnan(smooth_ratio) else smooth_ratio <= SMOOTHNESS_LIMIT,
        relative_recoverable=None if math.isnan(relative) else relative <= RELATIVE_TOLERANCE,
        beyond_max_positions=limit is None or limit > scheme.config.max_positions,
    )


def default_schemes(config: ModelConfig, seed: int = 0) -> list[PositionalScheme]:
    """Every registered scheme with its default parameters on `config`'s architecture, with
    trainable tables initialised from `seed` (as an untrained model would have them)."""
    schemes = []
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for name in SCHEMES:
            schemes.append(build_scheme(config.replace(positional={"scheme": name})))
    return schemes


def requirement_table(
    schemes: Iterable[PositionalScheme], n_positions: int
) -> list[RequirementRow]:
    """measure_requirements for each scheme, in order."""
    return [measure_requirements(scheme, n_positions) for scheme in schemes]
