"""Positional geometry (the geometry paper, seed 003): Hellinger statistics of positions, classical
MDS, stress and monotonicity diagnostics, the paper's synthetic corpus, and the five requirements
of a positional encoding measured for every scheme.

- metrics: positional distributions, Hellinger matrix, noise floor, classical MDS, diagnostics
- synthetic: the seeded three-regime corpus and the rank–stress–parameter table
- representations: one vector per position for any scheme (additive, rope, bias)
- requirements: bounded / unique / length-independent / smooth / relative, as numbers
"""

from lab.geometry.metrics import (
    GeometryInputError,
    MDSResult,
    classical_mds,
    effective_rank,
    hellinger_matrix,
    min_separation,
    monotonicity_violation_rate,
    noise_floor,
    optimal_scale,
    pairwise_distances,
    positional_distributions,
    scale_free_stress,
    split_half_noise_floor,
    stress,
    variance_captured,
)
from lab.geometry.representations import encode_positions, scheme_representation
from lab.geometry.requirements import (
    RequirementRow,
    default_schemes,
    first_refused_position,
    measure_requirements,
    requirement_table,
)
from lab.geometry.synthetic import (
    PAPER_FIGURES,
    RankStressRow,
    SyntheticCorpus,
    empirical_hellinger,
    rank_stress_table,
    synthetic_corpus,
    synthetic_figures,
)

__all__ = [
    "PAPER_FIGURES",
    "GeometryInputError",
    "MDSResult",
    "RankStressRow",
    "RequirementRow",
    "SyntheticCorpus",
    "classical_mds",
    "default_schemes",
    "effective_rank",
    "empirical_hellinger",
    "encode_positions",
    "first_refused_position",
    "hellinger_matrix",
    "measure_requirements",
    "min_separation",
    "monotonicity_violation_rate",
    "noise_floor",
    "optimal_scale",
    "pairwise_distances",
    "positional_distributions",
    "rank_stress_table",
    "requirement_table",
    "scale_free_stress",
    "scheme_representation",
    "split_half_noise_floor",
    "stress",
    "synthetic_corpus",
    "synthetic_figures",
    "variance_captured",
]
