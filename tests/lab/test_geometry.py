"""Properties of the positional-geometry math (lab.geometry), checked over random inputs."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from lab.geometry.metrics import (
    GeometryInputError,
    classical_mds,
    effective_rank,
    hellinger_matrix,
    min_separation,
    monotonicity_violation_rate,
    noise_floor,
    pairwise_distances,
    positional_distributions,
    scale_free_stress,
    split_half_noise_floor,
    stress,
    variance_captured,
)
from lab.geometry.report import FIGURES, REPORT_FILE, run, write_report
from lab.geometry.representations import scheme_representation
from lab.geometry.requirements import (
    RequirementRow,
    default_schemes,
    first_refused_position,
    measure_requirements,
    requirement_table,
)
from lab.geometry.synthetic import (
    PAPER_FIGURES,
    empirical_hellinger,
    rank_stress_table,
    synthetic_corpus,
    synthetic_figures,
)
from model.checkpoint import save_checkpoint
from model.config import ModelConfig
from model.positional import SCHEMES, TABLE_SCHEMES, PositionalScheme, build_scheme
from model.positional.sinusoidal import sinusoidal_table
from model.transformer import Transformer
from ordinal import geometry_options, main
from tests.model.conftest import tiny_config, tree_digest

SEEDS = range(5)


def random_distributions(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    """n random distributions over `vocab` tokens, some with exact zeros."""
    mu = rng.dirichlet(np.full(vocab, 0.5), size=n)
    mu[rng.random((n, vocab)) < 0.2] = 0.0
    mu[:, 0] += 1e-3  # keep every row non-empty
    return mu / mu.sum(axis=1, keepdims=True)


# ------------------------------------------------------------------------ positional statistics


@pytest.mark.parametrize("seed", SEEDS)
def test_hellinger_is_a_bounded_metric(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 30))
    hellinger = hellinger_matrix(random_distributions(rng, n, int(rng.integers(2, 300))))
    assert np.allclose(hellinger, hellinger.T)
    assert np.all(np.diag(hellinger) == 0)
    assert np.all(hellinger <= np.sqrt(2) + 1e-12)
    # triangle inequality over every triple: H[i, k] <= H[i, j] + H[j, k]
    through_j = hellinger[:, :, None] + hellinger[None, :, :]
    assert np.all(hellinger[:, None, :] <= through_j + 1e-12)


def test_hellinger_reaches_sqrt2_for_disjoint_supports() -> None:
    mu = np.array([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.25, 0.75]])
    assert hellinger_matrix(mu)[0, 1] == pytest.approx(np.sqrt(2))


@pytest.mark.parametrize("seed", SEEDS)
def test_positional_distributions_normalise_and_smooth(seed: int) -> None:
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 50, size=(8, 30))
    counts[:, 0] += 1
    mu = positional_distributions(counts, counts.sum(axis=1))
    assert np.allclose(mu.sum(axis=1), 1.0)
    assert np.allclose(mu * counts.sum(axis=1, keepdims=True), counts)
    smoothed = positional_distributions(counts, epsilon=1e-3)
    assert np.allclose(smoothed.sum(axis=1), 1.0)
    assert np.all(smoothed > 0)


def test_positional_distributions_reject_bad_input() -> None:
    counts = np.array([[3, 1], [0, 2]])
    with pytest.raises(GeometryInputError, match="epsilon"):
        positional_distributions(counts, epsilon=1.0)
    with pytest.raises(GeometryInputError, match=r"n_i\[1\]"):
        positional_distributions(counts, [4, 5])
    with pytest.raises(GeometryInputError, match="no tokens"):
        positional_distributions(np.array([[3, 1], [0, 0]]))
    with pytest.raises(GeometryInputError, match="2-D"):
        positional_distributions(np.array([1, 2, 3]))


@pytest.mark.parametrize("seed", SEEDS)
def test_split_half_noise_floor_matches_multinomial_noise(seed: int) -> None:
    # Uniform tokens: each half's estimate of √μ has squared error (V − 1)/(4 · N/2), so the two
    # halves differ by E d_H² ≈ (V − 1)/N.
    rng = np.random.default_rng(seed)
    vocab, n_sequences, n_positions = 20, 4000, 64
    tokens = rng.integers(0, vocab, size=(n_sequences, n_positions))
    floor = split_half_noise_floor(tokens, n_positions, vocab, seed=seed)
    assert floor.shape == (n_positions,)
    assert np.mean(floor**2) == pytest.approx((vocab - 1) / n_sequences, rel=0.15)
    assert np.array_equal(floor, split_half_noise_floor(tokens, n_positions, vocab, seed=seed))


def test_noise_floor_is_zero_for_identical_halves() -> None:
    counts = np.random.default_rng(0).integers(1, 9, size=(5, 7))
    assert np.all(noise_floor(counts, 2 * counts) == 0)


# -------------------------------------------------------------------------------- classical MDS


@pytest.mark.parametrize("seed", range(8))
def test_mds_recovers_points_living_in_rk(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 7))
    n = int(rng.integers(k + 2, 60))
    points = rng.normal(size=(n, k)) * rng.uniform(0.1, 5.0)
    # Place them in a random k-dimensional subspace of a wider space, shifted off the origin.
    basis, _ = np.linalg.qr(rng.normal(size=(k + 5, k)))
    embedded = points @ basis.T + rng.normal(size=k + 5)
    distances = pairwise_distances(embedded)

    result = classical_mds(distances)
    assert effective_rank(result.eigenvalues) == k
    assert result.positions.shape == (n, k)
    assert stress(result.positions, distances) < 1e-8
    assert variance_captured(result.eigenvalues, k) == pytest.approx(1.0)
    assert np.all(np.diff(result.eigenvalues) <= 1e-12)  # descending


def test_mds_caps_rank_and_fixes_signs() -> None:
    rng = np.random.default_rng(3)
    distances = pairwise_distances(rng.normal(size=(12, 2)))
    positions = classical_mds(distances, rank=5).positions
    assert positions.shape == (12, 2)
    largest = positions[np.argmax(np.abs(positions), axis=0), [0, 1]]
    assert np.all(largest > 0)


def test_mds_rejects_non_distance_matrices() -> None:
    with pytest.raises(GeometryInputError, match="square"):
        classical_mds(np.zeros((3, 4)))
    with pytest.raises(GeometryInputError, match="symmetric"):
        classical_mds(np.array([[0.0, 1.0], [2.0, 0.0]]))
    with pytest.raises(GeometryInputError, match="diagonal"):
        classical_mds(np.array([[1.0, 1.0], [1.0, 0.0]]))
    with pytest.raises(GeometryInputError, match="rank"):
        classical_mds(np.zeros((3, 3)), rank=4)


# --------------------------------------------------------------------------- diagnostics of P


@pytest.mark.parametrize("seed", SEEDS)
def test_scale_free_stress_is_at_most_stress_and_scale_invariant(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 40))
    hellinger = hellinger_matrix(random_distributions(rng, n, 50))
    encoding = rng.normal(size=(n, int(rng.integers(1, 20)))) * rng.uniform(0.01, 10)
    scale = rng.uniform(0.01, 100)
    assert scale_free_stress(encoding, hellinger) <= stress(encoding, hellinger) + 1e-15
    assert scale_free_stress(scale * encoding, hellinger) == pytest.approx(
        scale_free_stress(encoding, hellinger), rel=1e-9
    )


def brute_force_violation_rate(encoding: np.ndarray) -> float:
    distances = pairwise_distances(encoding)
    n = len(encoding)
    comparable = violations = 0
    for i, j, k in itertools.permutations(range(n), 3):
        if abs(i - j) < abs(i - k):
            comparable += 1
            violations += distances[i, j] > distances[i, k]
    return violations / comparable


@pytest.mark.parametrize("seed", SEEDS)
def test_monotonicity_count_is_exact(seed: int) -> None:
    rng = np.random.default_rng(seed)
    encoding = rng.normal(size=(int(rng.integers(3, 20)), 3))
    assert monotonicity_violation_rate(encoding) == pytest.approx(
        brute_force_violation_rate(encoding), abs=1e-12
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_random_matrix_violates_monotonicity_half_the_time(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(96, 257))
    encoding = rng.normal(0.0, 0.02, size=(n, int(rng.integers(16, 129))))
    assert monotonicity_violation_rate(encoding) == pytest.approx(0.5, abs=0.03)


def test_points_on_a_line_never_violate_monotonicity() -> None:
    line = np.arange(40.0)[:, None] * np.random.default_rng(0).normal(size=(1, 5))
    assert monotonicity_violation_rate(line) == 0.0


@pytest.mark.parametrize("seed", SEEDS)
def test_min_separation(seed: int) -> None:
    rng = np.random.default_rng(seed)
    encoding = rng.normal(size=(int(rng.integers(2, 30)), 4))
    pairs = itertools.combinations(range(len(encoding)), 2)
    expected = min(np.linalg.norm(encoding[i] - encoding[j]) for i, j in pairs)
    assert min_separation(encoding) == pytest.approx(expected)
    duplicated = np.vstack([encoding, encoding[:1]])
    assert min_separation(duplicated) == 0.0


# ---------------------------------------------------------------------------- synthetic corpus


@pytest.fixture(scope="module", params=[0, 1])
def corpus_hellinger(request: pytest.FixtureRequest) -> np.ndarray:
    return empirical_hellinger(synthetic_corpus(seed=request.param))


def test_synthetic_corpus_mds_beats_sinusoidal(corpus_hellinger: np.ndarray) -> None:
    n = corpus_hellinger.shape[0]
    sinusoidal = stress(sinusoidal_table(n, 16), corpus_hellinger)
    full_rank = stress(classical_mds(corpus_hellinger).positions, corpus_hellinger)
    rank16 = stress(classical_mds(corpus_hellinger, rank=16).positions, corpus_hellinger)
    assert full_rank < 0.05
    assert full_rank < sinusoidal / 50
    assert rank16 < sinusoidal / 50  # the paper's d = 16 comparison


def test_synthetic_corpus_has_low_intrinsic_dimension(corpus_hellinger: np.ndarray) -> None:
    eigenvalues = classical_mds(corpus_hellinger).eigenvalues
    assert effective_rank(eigenvalues) == corpus_hellinger.shape[0] - 1
    # three regimes -> two dominant eigenvalues (paper: 79.9 % of the variance)
    assert 0.7 < variance_captured(eigenvalues, 2) < 0.9
    assert variance_captured(eigenvalues, 3) - variance_captured(eigenvalues, 2) < 0.05


def test_rank_stress_table_trades_parameters_for_stress(corpus_hellinger: np.ndarray) -> None:
    rows = rank_stress_table(corpus_hellinger, d_model=128)
    mds_rows = [row for row in rows if row.encoding.startswith("mds")]
    stresses = [row.stress for row in mds_rows]
    assert stresses == sorted(stresses, reverse=True)
    assert [row.parameters for row in mds_rows] == [r * (32 + 128) for r in (1, 2, 3, 4, 8, 16, 31)]
    free, sinusoidal = rows[-2], rows[-1]
    assert free.parameters == 32 * 128 and free.stress < 1e-20
    assert sinusoidal.parameters == 0
    rank3 = mds_rows[2]
    assert rank3.parameters == 480 and rank3.stress < sinusoidal.stress / 100


def test_synthetic_corpus_is_seeded_and_validated() -> None:
    first = synthetic_corpus(seed=4, n_sequences=50)
    again = synthetic_corpus(seed=4, n_sequences=50)
    assert np.array_equal(first.tokens, again.tokens)
    assert first.tokens.shape == (50, 32)
    assert np.allclose(first.distributions.sum(axis=1), 1.0)
    assert list(np.bincount(first.regimes)) == [8, 16, 8]
    with pytest.raises(GeometryInputError, match="signature_tokens"):
        synthetic_corpus(signature_tokens=7)


def test_synthetic_figures_are_near_the_papers() -> None:
    figures = synthetic_figures(synthetic_corpus(seed=0))
    assert set(PAPER_FIGURES) <= set(figures)
    for name in ("variance_top2", "variance_top3", "mds_stress_rank3", "sinusoidal_stress_d16"):
        assert figures[name] == pytest.approx(PAPER_FIGURES[name], rel=0.1), name


# ------------------------------------------------------------- scheme representations (part 2)

SMALL = ModelConfig(
    vocab_size=64, d_model=32, n_layers=1, n_heads=4, d_ff=64, context_length=16, max_positions=64
)


def build(name: str, config: ModelConfig = SMALL, **params: object) -> PositionalScheme:
    return build_scheme(config.replace(positional={"scheme": name, **params}))


def test_representation_shapes() -> None:
    n = 10
    assert scheme_representation(build("none"), n) is None
    assert scheme_representation(build("sinusoidal"), n).shape == (n, SMALL.d_model)
    assert scheme_representation(build("alibi"), n).shape == (n, SMALL.n_heads * n)
    assert scheme_representation(build("t5"), n, n_keys=3).shape == (n, SMALL.n_heads * 3)
    rotated = scheme_representation(build("rope"), n)
    assert rotated.shape == (n, SMALL.d_model)
    assert torch.allclose(rotated.norm(dim=1), torch.ones(n, dtype=torch.float64), atol=1e-6)


@pytest.fixture(scope="module")
def requirements() -> dict[str, RequirementRow]:
    rows = requirement_table(default_schemes(SMALL), SMALL.context_length)
    return {row.scheme: row for row in rows}


def test_requirement_table_covers_every_scheme(requirements: dict[str, RequirementRow]) -> None:
    assert set(requirements) == set(SCHEMES)


def test_integer_is_unbounded(requirements: dict[str, RequirementRow]) -> None:
    assert requirements["integer"].bounded is False
    assert requirements["integer"].bounded_growth == pytest.approx(63 / 15, rel=1e-6)
    for name in ("binary", "sinusoidal", "rope", "learned", "t5", "mds", "lowrank"):
        assert requirements[name].bounded is True, name


def test_binary_is_not_smooth(requirements: dict[str, RequirementRow]) -> None:
    assert requirements["binary"].smooth is False
    for name in ("sinusoidal", "rope", "integer", "alibi"):
        assert requirements[name].smooth is True, name


def test_relative_distance_is_recovered_by_each_relative_way_of_acting(
    requirements: dict[str, RequirementRow],
) -> None:
    # a shift map (sinusoidal's M_k), a rotation (rope) and a bias of i − j (alibi, t5)
    for name in ("sinusoidal", "rope", "alibi", "t5"):
        assert requirements[name].relative_recoverable is True, name
        assert requirements[name].relative_error < 1e-6, name
    for name in ("integer", "binary", "learned", "mds", "lowrank"):
        assert requirements[name].relative_recoverable is False, name
    assert requirements["none"].relative_recoverable is None  # nothing reaches the scores


class AbsoluteBias(PositionalScheme):
    """A score bias of i · j: a bias, but of the absolute positions."""

    name = "absolute-bias"

    def attention_bias(self, q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
        product = (q_positions.unsqueeze(-1) * k_positions).float() * 1e-3  # [B, Tq, Tk]
        return product.unsqueeze(1).expand(-1, self.config.n_heads, -1, -1)


class QuadraticRotation(PositionalScheme):
    """Rope's rotation with angles p²/100: a rotation, but not by an angle linear in p."""

    name = "quadratic-rotation"

    def rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = (positions.double() ** 2 / 100).unsqueeze(-1)  # [B, T, 1]
        angles = angles.expand(*positions.shape, self.config.head_dim).unsqueeze(1)
        return angles.cos().float(), angles.sin().float()  # [B, 1, T, head_dim]


@pytest.mark.parametrize("scheme", [AbsoluteBias, QuadraticRotation])
def test_relative_distance_is_refused_to_absolute_biases_and_rotations(
    scheme: type[PositionalScheme],
) -> None:
    row = measure_requirements(scheme(SMALL, None), SMALL.context_length)
    assert row.relative_recoverable is False
    assert row.relative_error > 0.1


def test_tables_cannot_go_past_max_positions(requirements: dict[str, RequirementRow]) -> None:
    for name in TABLE_SCHEMES:
        assert requirements[name].beyond_max_positions is False, name
        assert requirements[name].position_limit == SMALL.max_positions, name
    for name in ("none", "integer", "sinusoidal", "rope", "alibi", "t5"):
        assert requirements[name].position_limit is None, name
        assert requirements[name].beyond_max_positions is True, name
    # binary's own limit is 2**bits, measured, not looked up
    assert requirements["binary"].position_limit == 2**16


NO_POSITION_ONLY_SIGNAL = ("none", "data-dependent", "weights")


def test_every_scheme_with_a_position_only_signal_is_unique(
    requirements: dict[str, RequirementRow],
) -> None:
    # none has no positional signal; fox, cope and PaTH have one only through the content (their
    # bias or turn comes from each layer's inputs), and stick-breaking only through its weights'
    # process, so nothing position-only tells their positions apart.
    silent = {name for name, scheme in SCHEMES.items() if scheme.kind in NO_POSITION_ONLY_SIGNAL}
    assert silent == {"none", "fox", "cope", "stickbreaking", "path", "pathfox"}
    for name in silent:
        assert requirements[name].unique is False, name
    assert all(row.unique for name, row in requirements.items() if name not in silent)
    assert all(row.length_independent for row in requirements.values())


def test_fire_sees_the_query_position_unless_it_reads_the_raw_distance() -> None:
    """Progressive interpolation divides by ψ(max(L, i)): the bias of a distance changes with
    the query once i passes L; without the division (normalise off) it is a function of i − j."""
    normalised = measure_requirements(build("fire", SMALL, threshold=4.0), SMALL.context_length)
    assert normalised.relative_recoverable is False
    raw = measure_requirements(build("fire", SMALL, normalise=False), SMALL.context_length)
    assert raw.relative_recoverable is True and raw.relative_error < 1e-6


@pytest.mark.parametrize("max_positions", [16, 37, 100])
def test_position_limit_is_found_by_probing(max_positions: int) -> None:
    config = SMALL.replace(context_length=16, max_positions=max_positions)
    for name in TABLE_SCHEMES:
        assert first_refused_position(build(name, config)) == max_positions
    assert first_refused_position(build("binary", config, bits=5)) == 32


class LengthNormalisedInteger(PositionalScheme):
    """Seed 000's normalised integer encoding, p / T: bounded but length-dependent."""

    name = "normalised-integer"

    def embedding(self, positions: torch.Tensor) -> torch.Tensor:
        value = positions.float() / positions.shape[-1]
        return value.unsqueeze(-1).expand(*positions.shape, self.config.d_model)


def test_length_dependence_is_detected() -> None:
    row = measure_requirements(LengthNormalisedInteger(SMALL, None), 16)
    assert row.length_independent is False
    assert row.length_drift == pytest.approx(0.5 * 15 / 15, rel=1e-6)
    assert row.bounded is True


# ----------------------------------------------------------------------------------- report


def test_geometry_report_writes_json_and_figures(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    geometry_options(parser)
    args = parser.parse_args(["--out", str(tmp_path), "--n-positions", "12", "--d-model", "32"])
    report = run(args)

    on_disk = json.loads((tmp_path / REPORT_FILE).read_text())
    assert on_disk == report
    for name in report["figures"]:
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG"), name
    assert len(report["hellinger"]["matrix"]) == 12
    assert len(report["hellinger"]["noise_floor"]) == 12
    assert {entry["scheme"] for entry in report["schemes"]} == set(SCHEMES)
    assert {row["scheme"] for row in report["requirements"]} == set(SCHEMES)
    by_scheme = {entry["scheme"]: entry for entry in report["schemes"]}
    # the installed P_MDS (rank 11 = n - 1 here) reproduces the corpus geometry exactly
    assert by_scheme["mds"]["stress"] < 1e-10
    assert by_scheme["sinusoidal"]["stress"] > 1.0
    assert "paper_comparison" not in report  # only at the paper's n = 32


def test_geometry_out_is_written_whole_and_never_over_a_users_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    out.mkdir()
    (out / "notes.md").write_text("a user's folder")
    argv = ["geometry", "--out", str(out), "--n-positions", "8", "--d-model", "16"]
    before = tree_digest(tmp_path)
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("ordinal geometry: error: OUT ") and "--force" in error
    assert tree_digest(tmp_path) == before
    assert main([*argv, "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(["report.json", "report.md", *FIGURES])
    assert main(argv) == 0  # an earlier report: replaced without --force
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


def test_geometry_report_rejects_unknown_corpus(tmp_path: Path) -> None:
    with pytest.raises(GeometryInputError, match="corpus"):
        write_report(tmp_path, corpus="wikipedia", n_positions=8)


def test_geometry_report_measures_trained_checkpoints(
    tmp_path: Path, tiny_tokenizer: Tokenizer
) -> None:
    folders = []
    for name in ("learned", "rope"):
        folder = tmp_path / f"tiny-{name}"
        save_checkpoint(folder, Transformer(tiny_config(name)), tiny_tokenizer)
        folders.append(folder)
    report = write_report(tmp_path / "report", "synthetic", folders, d_model=999)

    context = tiny_config().context_length
    assert report["corpus"]["n_positions"] == min(32, context)
    labels = [entry["label"] for entry in report["schemes"]]
    assert labels == ["tiny-learned (learned)", "tiny-rope (rope)"]
    learned, rope = report["requirements"]
    assert learned["position_limit"] == tiny_config().max_positions
    assert rope["relative_recoverable"] is True
    # the table width follows the checkpoints, not the unused d_model argument
    assert report["rank_stress_table"][-1]["encoding"] == f"sinusoidal d={tiny_config().d_model}"
