"""Training curves: train and validation loss against tokens seen, one colour per checkpoint.

Reads what ``ordinal train`` records in each checkpoint's ``metrics.json``: ``train_loss`` and
``val_loss`` as ``[step, loss]`` pairs, and the train config that turns steps into tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from model.files import METRICS_FILE, write_figure_atomic

if TYPE_CHECKING:
    from matplotlib.typing import ColorType

SMOOTHING_STEPS = 50  # the train loss of one batch is noisy: a moving average over this many


def checkpoint_label(folder: str, scheme: str) -> str:
    """How plots and tables name a checkpoint: its scheme, or "folder (scheme)" for a folder not
    named after it (``prope (rope)``, ``drope (none)``); ``rope+yarn4`` counts as rope's."""
    return scheme if folder == scheme.split("+")[0] else f"{folder} ({scheme})"


def series_colour(index: int) -> ColorType:
    """The colour of the ``index``-th line of a plot: matplotlib's tab20, its ten dark shades
    first, then the light ones, so up to twenty lines stay apart."""
    import matplotlib

    palette = matplotlib.color_sequences["tab20"]
    return palette[(2 * index + index // 10) % len(palette)]


@dataclass(frozen=True)
class Curves:
    """One run's losses (nats/token) against tokens seen (a run started from another checkpoint,
    ``--init``, counts the base's tokens too)."""

    label: str  # checkpoint_label
    train_tokens: np.ndarray  # [steps]
    train_loss: np.ndarray  # [steps], moving average over SMOOTHING_STEPS
    val_tokens: np.ndarray  # [evals]
    val_loss: np.ndarray  # [evals]
    wall_seconds: float


def tokens_per_step(metrics: dict[str, Any]) -> int:
    """Training tokens one optimizer step consumes: sequences × context."""
    train, model = metrics["train"], metrics["model"]
    return int(train["batch_size"] * train["grad_accum"] * model["context_length"])


def read_curves(folder: Path) -> Curves:
    """The curves recorded in ``folder/metrics.json``."""
    metrics = json.loads((folder / METRICS_FILE).read_text())
    per_step = tokens_per_step(metrics)
    before = metrics.get("init", {}).get("tokens_seen", 0)  # DroPE continues its base
    train = np.asarray(metrics["train_loss"], dtype=float).reshape(-1, 2)
    val = np.asarray(metrics["val_loss"], dtype=float).reshape(-1, 2)
    return Curves(
        label=checkpoint_label(folder.name, metrics["scheme"]),
        train_tokens=before + train[:, 0] * per_step,
        train_loss=moving_average(train[:, 1], SMOOTHING_STEPS),
        val_tokens=before + val[:, 0] * per_step,
        val_loss=val[:, 1],
        wall_seconds=float(metrics["wall_seconds"]),
    )


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to ``window`` values (fewer at the start): [n] → [n]."""
    sums = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def plot_training_curves(folders: list[Path], path: Path) -> None:
    """Train (thin) and validation (markers) loss against tokens for every folder, side by side
    with a zoom on the last half of training where the schemes separate; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    runs = [read_curves(folder) for folder in folders]
    figure = Figure(figsize=(13, 5.5))
    whole, zoom = figure.subplots(1, 2)
    for index, run in enumerate(runs):
        colour = series_colour(index)
        for axes in (whole, zoom):
            axes.plot(run.train_tokens / 1e6, run.train_loss, color=colour, linewidth=1, alpha=0.8)
            label = f"{run.label} ({run.wall_seconds / 60:.1f} min)"
            axes.plot(run.val_tokens / 1e6, run.val_loss, "o--", color=colour, markersize=4,
                      linewidth=1, label=label)  # fmt: skip
    half = max(run.train_tokens[-1] for run in runs) / 2e6
    last_half = [
        loss
        for run in runs
        for tokens, losses in ((run.train_tokens, run.train_loss), (run.val_tokens, run.val_loss))
        for loss in losses[tokens / 1e6 >= half]
    ]
    zoom.set_xlim(left=half)
    if last_half:
        zoom.set_ylim(min(last_half) - 0.05, max(last_half) + 0.05)
    whole.set_ylim(top=min(whole.get_ylim()[1], 8.0))
    for axes, title in ((whole, "all of training"), (zoom, "second half")):
        axes.set_xlabel("tokens seen (millions)")
        axes.set_ylabel("loss (nats/token)")
        axes.set_title(title)
        axes.grid(alpha=0.3)
    zoom.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=9,
                title="scheme (train wall time)")  # fmt: skip
    figure.suptitle(
        f"Training curves: train loss ({SMOOTHING_STEPS}-step moving average, lines) and "
        "validation loss (markers)"
    )
    figure.tight_layout()
    write_figure_atomic(path, figure)


def main(argv: list[str] | None = None) -> int:
    """``python -m lab.curves CHECKPOINT... --out PNG`` (files without metrics.json skipped)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lab.curves", description=__doc__)
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    folders = [folder for folder in args.folders if (folder / METRICS_FILE).is_file()]
    if not folders:
        parser.error("none of the folders holds a metrics.json")
    plot_training_curves(folders, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
