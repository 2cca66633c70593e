"""``ordinal geometry``: the positional-geometry report of a corpus and a set of schemes.

``write_report`` measures a corpus (the paper's synthetic one, or the Shakespeare training split as
the model sees it) and a set of positional schemes (every scheme untrained, or the schemes of
given checkpoints), and writes report.json plus six figures into one folder:

- hellinger.png: the Hellinger matrix, and neighbour distances beside the sampling-noise floor;
- eigenspectrum.png: eigenvalues of the MDS Gram matrix and the variance they capture;
- mds_scatter.png: the positions in the top two MDS coordinates, coloured by position;
- stress.png: raw and scale-free stress of every scheme against the corpus geometry;
- dot_products.png: mean PE_i·PE_j against the offset j − i, per scheme;
- requirements.png: the five requirements, measured, per scheme.

The folder (report.json, report.md and the figures) is written beside ``--out`` and swapped in
whole (``model.checkpoint.staged_folder``), where ``model.files.check_output`` allows: an
earlier report is replaced, a folder holding anything else only with ``--force``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from tqdm import tqdm

from lab.curves import series_colour
from lab.data import boundary_sequences, encode_documents
from lab.geometry.corpus import CorpusGeometry, measure_corpus
from lab.geometry.metrics import (
    GeometryInputError,
    MDSResult,
    classical_mds,
    effective_rank,
    min_separation,
    monotonicity_violation_rate,
    scale_free_stress,
    stress,
    variance_captured,
)
from lab.geometry.representations import position_vectors
from lab.geometry.requirements import RequirementRow, default_schemes, requirement_table
from lab.geometry.synthetic import (
    PAPER_FIGURES,
    TABLE_RANKS,
    rank_stress_table,
    synthetic_corpus,
    synthetic_figures,
)
from lab.markdown import markdown_table
from model.checkpoint import staged_folder
from model.config import ModelConfig
from model.files import OutputKind, check_output, only_files
from model.positional import MdsPositions, PositionalScheme, PositionOutOfRange

CORPORA = ("synthetic", "shakespeare")
REPORT_FILE = "report.json"
REPORT_PAGE = "report.md"
FIGURES = (
    "hellinger.png",
    "eigenspectrum.png",
    "mds_scatter.png",
    "stress.png",
    "dot_products.png",
    "requirements.png",
)
# An earlier report: a folder of nothing but what write_report writes.
REPORT = OutputKind(
    "an earlier geometry report",
    folder=True,
    earlier=lambda path: only_files(path, {REPORT_FILE, REPORT_PAGE, *FIGURES}),
)
DEFAULT_N_POSITIONS = {"synthetic": 32, "shakespeare": 128}
TEXT_N_POSITIONS = 128  # the default for a corpus of your own
REQUIREMENTS = ("bounded", "unique", "length_independent", "smooth", "relative_recoverable")


def load_corpus_geometry(
    corpus: str, n_positions: int, seed: int = 0, tokenizer_path: str | Path | None = None
) -> CorpusGeometry:
    """The synthetic corpus (seeded), or the training split of the Shakespeare corpus or of
    the text at the path `corpus` (``lab.text_corpus``), tokenised with the tokenizer at
    `tokenizer_path` and cut into one training sequence per document (speech), exactly as
    training sees it (``<|bos|>`` first, running on past the document's end)."""
    if corpus == "synthetic":
        generated = synthetic_corpus(seed=seed, n_positions=n_positions)
        tokens = torch.from_numpy(generated.tokens)
        return measure_corpus(corpus, tokens, generated.vocab_size, None, seed)
    check_corpus(corpus)
    if tokenizer_path is None:
        raise GeometryInputError(f"the {corpus} corpus needs a tokenizer (tokenizer_path)")
    from lab.corpus import load_corpus
    from lab.text_corpus import open_text_corpus
    from model.tokenizer import load_tokenizer, special_ids

    tokenizer = load_tokenizer(tokenizer_path)
    special = special_ids(tokenizer)
    texts = (
        load_corpus().train
        if corpus == "shakespeare"
        else open_text_corpus(corpus).documents_of("train")
    )
    documents = encode_documents(tokenizer, texts)
    inputs = boundary_sequences(documents, n_positions, special)
    return measure_corpus(corpus, inputs, tokenizer.get_vocab_size(), special.pad, seed)


def check_corpus(corpus: str) -> None:
    """A GeometryInputError unless ``corpus`` is a named corpus or an existing path."""
    if corpus not in CORPORA and not Path(corpus).exists():
        raise GeometryInputError(
            f"corpus must be one of {list(CORPORA)} or the path of your text, got {corpus!r}"
        )


def untrained_schemes(
    geometry: CorpusGeometry, d_model: int = 128, seed: int = 0
) -> list[tuple[str, PositionalScheme]]:
    """Every scheme with default parameters at `d_model` for n = the corpus's positions (tables
    of exactly n rows), trainable tables at their seeded initialisation and the ``mds`` table
    filled with the corpus's P_MDS, as training would fill it."""
    n = geometry.n_positions
    config = ModelConfig(
        vocab_size=geometry.vocab_size,
        d_model=d_model,
        n_layers=1,
        n_heads=4,
        d_ff=4 * d_model,
        context_length=n,
        max_positions=n,
    )
    schemes = default_schemes(config, seed)
    for scheme in schemes:
        if isinstance(scheme, MdsPositions):
            rank = min(scheme.params.rank, n)
            coordinates = classical_mds(geometry.hellinger, rank=rank).positions
            scheme.set_coordinates(torch.from_numpy(coordinates))
    return [(scheme.name, scheme) for scheme in schemes]


def checkpoint_schemes(checkpoints: Sequence[str | Path]) -> list[tuple[str, PositionalScheme]]:
    """The positional module of each checkpoint, labelled "<folder> (<scheme>)"."""
    from model.checkpoint import load_checkpoint

    labelled = []
    for path in checkpoints:
        scheme = load_checkpoint(path, device="cpu").model.positional
        labelled.append((f"{Path(path).name} ({scheme.name})", scheme))
    return labelled


def dot_product_profile(vectors: torch.Tensor) -> list[float]:
    """Mean PE_i·PE_{i+k} for k = 0..n−1, divided by the mean squared norm.  vectors: [n, w]."""
    gram = (vectors @ vectors.T).numpy()
    means = [float(np.diagonal(gram, offset=k).mean()) for k in range(len(gram))]
    return [mean / means[0] if means[0] > 0 else math.nan for mean in means]


def scheme_diagnostics(label: str, scheme: PositionalScheme, hellinger: np.ndarray) -> dict:
    """Stress, scale-free stress, monotonicity, separation and dot-product profile of a scheme's
    representation of positions 0..n−1 against the corpus's Hellinger matrix [n, n]."""
    entry: dict[str, Any] = {"label": label, "scheme": scheme.name}
    try:
        vectors = position_vectors(scheme, hellinger.shape[0])
    except PositionOutOfRange as error:
        return {**entry, "error": str(error)}
    return {
        **entry,
        "width": vectors.shape[1],
        "stress": stress(vectors, hellinger),
        "scale_free_stress": scale_free_stress(vectors, hellinger),
        "monotonicity_violation_rate": monotonicity_violation_rate(vectors),
        "min_separation": min_separation(vectors),
        "dot_product_by_offset": dot_product_profile(vectors),
    }


# ---------------------------------------------------------------------------------- figures


def _plot_hellinger(geometry: CorpusGeometry) -> Figure:
    figure = Figure(layout="constrained", figsize=(11, 4.5))
    heatmap_axes, floor_axes = figure.subplots(1, 2)
    image = heatmap_axes.imshow(geometry.hellinger, cmap="viridis", vmin=0)
    figure.colorbar(image, ax=heatmap_axes, label="d_H")
    heatmap_axes.set(title=f"Hellinger distance ({geometry.name})", xlabel="j", ylabel="i")
    positions = np.arange(geometry.n_positions)
    neighbours = np.diagonal(geometry.hellinger, offset=1)
    floor_axes.plot(positions[:-1], neighbours, marker=".", label="d_H(μ_i, μ_i+1)")
    floor_axes.plot(positions, geometry.noise_floor, marker=".", label="split-half noise floor")
    floor_axes.set(title="neighbours vs sampling noise", xlabel="position i", ylabel="d_H")
    floor_axes.legend()
    return figure


def _plot_eigenspectrum(eigenvalues: np.ndarray) -> Figure:
    positive = eigenvalues[: effective_rank(eigenvalues)]
    figure = Figure(layout="constrained", figsize=(7, 4))
    axes = figure.subplots()
    ranks = np.arange(1, len(positive) + 1)
    axes.bar(ranks, positive / positive.sum(), label="share of variance")
    axes.plot(ranks, np.cumsum(positive) / positive.sum(), "k.-", label="cumulative")
    axes.set(title="eigenvalues of B = −½ J D² J", xlabel="k", ylabel="fraction of variance")
    axes.legend()
    return figure


def _plot_mds_scatter(coordinates: np.ndarray) -> Figure:
    figure = Figure(layout="constrained", figsize=(6, 5))
    axes = figure.subplots()
    points = np.pad(coordinates, ((0, 0), (0, max(0, 2 - coordinates.shape[1]))))
    axes.plot(points[:, 0], points[:, 1], color="lightgrey", zorder=1)
    scatter = axes.scatter(points[:, 0], points[:, 1], c=np.arange(len(points)), cmap="viridis")
    figure.colorbar(scatter, ax=axes, label="position")
    axes.set(title="positions in the top two MDS coordinates", xlabel="MDS 1", ylabel="MDS 2")
    return figure


def _plot_stress(schemes: list[dict]) -> Figure:
    measured = [entry for entry in schemes if "stress" in entry]
    labels = [entry["label"] for entry in measured]
    x = np.arange(len(measured))
    figure = Figure(layout="constrained", figsize=(max(6, 0.8 * len(measured) + 2), 4.5))
    axes = figure.subplots()
    floor = 1e-12  # log axes cannot show an exact zero
    raw = [max(entry["stress"], floor) for entry in measured]
    free = [max(entry["scale_free_stress"], floor) for entry in measured]
    axes.bar(x - 0.2, raw, width=0.4, label="stress")
    axes.bar(x + 0.2, free, width=0.4, label="scale-free stress")
    axes.set_yscale("log")
    axes.set_xticks(x, labels, rotation=45, ha="right")
    axes.set(title="stress against the corpus Hellinger geometry", ylabel="mean squared error")
    axes.legend()
    return figure


def _plot_dot_products(schemes: list[dict]) -> Figure:
    figure = Figure(layout="constrained", figsize=(7, 4.5))
    axes = figure.subplots()
    drawn = [
        entry
        for entry in schemes
        if entry.get("dot_product_by_offset") and not math.isnan(entry["dot_product_by_offset"][0])
    ]
    for index, entry in enumerate(drawn):
        # a checkpoint renamed from its scheme (prope: rope) dashed, so an equal profile shows
        renamed = "(" in entry["label"] and not entry["label"].startswith(f"{entry['scheme']} (")
        axes.plot(
            entry["dot_product_by_offset"],
            label=entry["label"],
            color=series_colour(index),
            linestyle="--" if renamed else "-",
        )
    axes.set(
        title="mean PE_i·PE_i+k / mean ‖PE_i‖²", xlabel="offset k = j − i", ylabel="dot product"
    )
    axes.legend(fontsize="small", ncol=2)
    return figure


def _plot_requirements(rows: list[RequirementRow], labels: list[str]) -> Figure:
    symbols = {True: "yes", False: "NO", None: "n/a"}
    colours = {True: "#c8e6c9", False: "#ffcdd2", None: "#eeeeee"}
    columns = [*REQUIREMENTS, "beyond_max_positions"]
    cells = [[symbols[getattr(row, name)] for name in columns] for row in rows]
    figure = Figure(layout="constrained", figsize=(12, 0.32 * len(rows) + 0.5))
    axes = figure.subplots()
    axes.axis("off")
    table = axes.table(
        cellText=cells,
        cellColours=[[colours[getattr(row, name)] for name in columns] for row in rows],
        rowLabels=labels,
        colLabels=[name.replace("_", " ") for name in columns],
        cellLoc="center",
        loc="center",
    )
    table.auto_set_font_size(False)  # matplotlib's automatic size shrinks it to ~7 pt
    table.set_fontsize(9)
    table.scale(1, 1.4)
    return figure


# ----------------------------------------------------------------------------------- report


def _json_ready(value: Any) -> Any:
    """numpy → Python, NaN/inf → None, recursively."""
    if isinstance(value, dict):
        return {str(key): _json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(item) for item in value]
    if isinstance(value, np.ndarray):
        return _json_ready(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _corpus_sections(geometry: CorpusGeometry, mds: MDSResult, seed: int) -> dict[str, Any]:
    """The corpus, Hellinger and MDS parts of report.json."""
    n = geometry.n_positions
    return {
        "corpus": {
            "name": geometry.name,
            "n_positions": n,
            "vocab_size": geometry.vocab_size,
            "n_sequences": len(geometry.sequences),
            "seed": seed,
        },
        "hellinger": {
            "matrix": geometry.hellinger,
            "neighbour_distance": np.diagonal(geometry.hellinger, offset=1),
            "noise_floor": geometry.noise_floor,
        },
        "mds": {
            "eigenvalues": mds.eigenvalues,
            "effective_rank": effective_rank(mds.eigenvalues),
            "variance_captured": {
                k: variance_captured(mds.eigenvalues, k) for k in (1, 2, 3, 4, 8, 16) if k < n
            },
        },
    }


# What write_report's progress bar counts, in order.
GEOMETRY_STAGES = ("corpus", "schemes", "requirements", "rank and stress", "figures")


def _advance(progress: tqdm) -> None:
    """Mark the current stage done and name the next one."""
    progress.update()
    if progress.n < len(GEOMETRY_STAGES):
        progress.set_postfix_str(GEOMETRY_STAGES[progress.n])


def write_report(
    out_dir: str | Path,
    corpus: str = "synthetic",
    checkpoints: Sequence[str | Path] = (),
    *,
    n_positions: int | None = None,
    d_model: int = 128,
    seed: int = 0,
    tokenizer_path: str | Path | None = None,
) -> dict[str, Any]:
    """Measure `corpus` and the schemes, write report.json and the PNGs into `out_dir`.

    corpus: "synthetic", "shakespeare" or the path of a text (``--data``'s forms); the last two
        need `tokenizer_path`, or take the tokenizer of the first checkpoint.
    checkpoints: checkpoint folders whose trained schemes are measured; when empty, every scheme
        is measured untrained at `d_model` (see untrained_schemes).
    n_positions: positions analysed (default 32 for synthetic, 128 for shakespeare, and never
        past the smallest context_length of the checkpoints).
    Returns the report (the content of report.json).
    """
    check_corpus(corpus)
    # One bar over the stages (on stderr); the corpus and the schemes take most of the time.
    progress = tqdm(total=len(GEOMETRY_STAGES), desc="geometry", unit="stage", leave=False)
    progress.set_postfix_str(GEOMETRY_STAGES[0])
    trained = checkpoint_schemes(checkpoints)
    # Trained tables end at their context; analyse no further than every checkpoint reaches.
    reach = [scheme.config.context_length for _, scheme in trained]
    n = n_positions or min([DEFAULT_N_POSITIONS.get(corpus, TEXT_N_POSITIONS), *reach])
    if n < 3:
        raise GeometryInputError(f"n_positions must be at least 3, got {n}")
    if corpus != "synthetic" and tokenizer_path is None and checkpoints:
        tokenizer_path = Path(checkpoints[0]) / "tokenizer.json"
    geometry = load_corpus_geometry(corpus, n, seed, tokenizer_path)
    _advance(progress)

    mds = classical_mds(geometry.hellinger)
    labelled = trained or untrained_schemes(geometry, d_model, seed)
    diagnostics = [scheme_diagnostics(label, s, geometry.hellinger) for label, s in labelled]
    _advance(progress)
    requirements = requirement_table([scheme for _, scheme in labelled], n)
    _advance(progress)
    table_width = trained[0][1].config.d_model if trained else d_model
    ranks = sorted({rank for rank in TABLE_RANKS if rank < n} | {n - 1})

    report: dict[str, Any] = {
        **_corpus_sections(geometry, mds, seed),
        "rank_stress_table": [
            row.to_dict() for row in rank_stress_table(geometry.hellinger, table_width, ranks)
        ],
        "schemes": diagnostics,
        "requirements": [
            {"label": label, **row.to_dict()}
            for (label, _), row in zip(labelled, requirements, strict=True)
        ],
    }
    _advance(progress)
    if corpus == "synthetic" and n == DEFAULT_N_POSITIONS["synthetic"]:
        measured = synthetic_figures(synthetic_corpus(seed=seed), noise_seed=seed)
        report["paper_comparison"] = {
            name: {"paper": paper, "measured": measured[name]}
            for name, paper in PAPER_FIGURES.items()
        }

    figures = dict(
        zip(
            FIGURES,
            (
                _plot_hellinger(geometry),
                _plot_eigenspectrum(mds.eigenvalues),
                _plot_mds_scatter(mds.positions[:, :2]),
                _plot_stress(diagnostics),
                _plot_dot_products(diagnostics),
                _plot_requirements(requirements, [label for label, _ in labelled]),
            ),
            strict=True,
        )
    )
    report["figures"] = sorted(figures)
    report = _json_ready(report)
    with staged_folder(out_dir) as staging:  # the folder whole, or the old one untouched
        for name, figure in figures.items():
            figure.savefig(staging / name, format="png", dpi=100)
        (staging / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
        (staging / REPORT_PAGE).write_text(report_markdown(report))
    _advance(progress)
    progress.close()
    return report


def _number(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.{digits}g}"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [[cell if isinstance(cell, str) else _number(cell) for cell in row] for row in rows]
    return [*markdown_table(header, cells), ""]


def report_markdown(report: dict[str, Any]) -> str:
    """The tables of report.json as markdown (written beside it as report.md)."""
    corpus, mds, hellinger = report["corpus"], report["mds"], report["hellinger"]
    floor, neighbour = hellinger["noise_floor"], hellinger["neighbour_distance"]
    noisy = [i for i, (f, d) in enumerate(zip(floor[1:], neighbour, strict=False), 1) if f >= d]
    lines = [
        f"### Corpus: {corpus['name']}",
        "",
        f"{corpus['n_sequences']:,} sequences, {corpus['n_positions']} positions, vocabulary "
        f"{corpus['vocab_size']:,}. Effective rank of the MDS Gram matrix: "
        f"{mds['effective_rank']}. Variance captured by the top k eigenvalues: "
        + ", ".join(f"k={k}: {v:.1%}" for k, v in mds["variance_captured"].items())
        + ". Split-half noise floor: median "
        f"{float(np.median(floor)):.3f}; it reaches the distance between neighbouring positions "
        + (f"from position {noisy[0]} on." if noisy else "nowhere."),
        "",
        "#### Encodings against the corpus geometry",
        "",
    ]
    lines += _table(
        ["encoding", "stress", "scale-free stress", "monotonicity violations", "min separation"],
        [
            [
                row["label"],
                row["stress"],
                row["scale_free_stress"],
                row["monotonicity_violation_rate"],
                row["min_separation"],
            ]
            for row in report["schemes"]
        ],
    )
    lines += ["#### The five requirements, measured", ""]
    lines += _table(
        [
            "encoding",
            "bounded (growth 4n/n)",
            "unique (min sep.)",
            "length-independent (drift)",
            "smooth (max step / median)",
            "relative (diag. spread)",
            "past max_positions",
        ],
        [
            [
                row["label"],
                f"{_number(row['bounded'])} ({_number(row['bounded_growth'])})",
                f"{_number(row['unique'])} ({_number(row['min_separation'])})",
                f"{_number(row['length_independent'])} ({_number(row['length_drift'])})",
                f"{_number(row['smooth'])} ({_number(row['smoothness'])})",
                f"{_number(row['relative_recoverable'])} ({_number(row['relative_error'])})",
                _number(row["beyond_max_positions"]),
            ]
            for row in report["requirements"]
        ],
    )
    lines += ["#### Rank, stress and parameters (P = A·Bᵀ from MDS)", ""]
    lines += _table(
        ["encoding", "parameters", "stress", "scale-free stress"],
        [
            [row["encoding"], row["parameters"], row["stress"], row["scale_free_stress"]]
            for row in report["rank_stress_table"]
        ],
    )
    if "paper_comparison" in report:
        lines += ["#### Against the paper's synthetic-corpus figures", ""]
        lines += _table(
            ["figure", "paper", "measured"],
            [
                [name, pair["paper"], pair["measured"]]
                for name, pair in report["paper_comparison"].items()
            ],
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Write the report per ``args`` (``ordinal geometry``'s options) and print where it went."""
    corpus_path = None if args.corpus in CORPORA else args.corpus
    read = [*args.checkpoints, corpus_path, args.tokenizer]
    check_output(args.out, REPORT, sources=read, force=getattr(args, "force", False))
    report = write_report(
        args.out,
        args.corpus,
        args.checkpoints,
        n_positions=args.n_positions,
        d_model=args.d_model,
        seed=args.seed,
        tokenizer_path=args.tokenizer,
    )
    print(f"wrote {args.out / REPORT_FILE} and {len(report['figures'])} figures")
    return report
