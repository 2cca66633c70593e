"""Training curves read metrics.json as ``ordinal train`` writes it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lab.curves import METRICS_FILE, moving_average, plot_training_curves, read_curves


def write_metrics(folder: Path, scheme: str, steps: int, batch: int, context: int) -> None:
    rng = np.random.default_rng(len(scheme))
    folder.mkdir(parents=True)
    train = [[step, float(8 - np.log(step) + rng.normal(0, 0.1))] for step in range(1, steps + 1)]
    metrics = {
        "scheme": scheme,
        "model": {"context_length": context},
        "train": {"batch_size": batch, "grad_accum": 2},
        "train_loss": train,
        "val_loss": [[step, 8 - np.log(step)] for step in range(10, steps + 1, 10)],
        "wall_seconds": 61.0,
    }
    (folder / METRICS_FILE).write_text(json.dumps(metrics))


@pytest.mark.parametrize("window", [1, 3, 50])
def test_moving_average_is_the_mean_of_the_trailing_window(window: int) -> None:
    values = np.random.default_rng(window).normal(size=37)
    expected = [values[max(0, i + 1 - window) : i + 1].mean() for i in range(len(values))]
    np.testing.assert_allclose(moving_average(values, window), expected)


def test_steps_become_tokens_seen(tmp_path: Path) -> None:
    write_metrics(tmp_path / "rope", "rope", steps=40, batch=4, context=16)
    curves = read_curves(tmp_path / "rope")
    per_step = 4 * 2 * 16  # batch × grad_accum × context
    assert curves.train_tokens.tolist() == [step * per_step for step in range(1, 41)]
    assert curves.val_tokens.tolist() == [step * per_step for step in (10, 20, 30, 40)]
    assert len(curves.train_loss) == 40


def test_a_run_from_another_checkpoint_continues_its_tokens_and_is_labelled_by_folder(
    tmp_path: Path,
) -> None:
    """DroPE (``--init``): its curve starts where its base's ended, and its folder, not its
    scheme (none), names it, as ``ordinal eval``'s table does."""
    write_metrics(tmp_path / "drope", "none", steps=20, batch=4, context=16)
    metrics = json.loads((tmp_path / "drope" / METRICS_FILE).read_text())
    metrics["init"] = {"checkpoint": "checkpoints/rope", "tokens_seen": 10_000}
    (tmp_path / "drope" / METRICS_FILE).write_text(json.dumps(metrics))
    curves = read_curves(tmp_path / "drope")
    assert curves.label == "drope (none)"
    assert curves.train_tokens[0] == 10_000 + 4 * 2 * 16
    write_metrics(tmp_path / "rope", "rope", steps=20, batch=4, context=16)
    assert read_curves(tmp_path / "rope").label == "rope"


def test_the_plot_is_a_png_written_in_one_piece(tmp_path: Path) -> None:
    folders = [tmp_path / name for name in ("rope", "alibi")]
    for folder in folders:
        write_metrics(folder, folder.name, steps=60, batch=2, context=8)
    out = tmp_path / "plots" / "curves.png"
    plot_training_curves(folders, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in out.parent.iterdir()] == ["curves.png"]  # no staging file left
