"""The scheme tables of README.md and checkpoints/README.md, generated from what the shipped
checkpoints' folders and the Shakespeare geometry report hold, never typed by hand.

    python -m lab.tables            # rewrite both tables in place
    python -m lab.tables --check    # exit 1 if either differs from what the files say

Each table sits between two marker lines (``<!-- scheme table: … -->``); everything else in the
two READMEs is prose. A row per checkpoint folder, in the registry's order (prope and drope, the
recipes on another scheme, last); README's table also has a row for a registered scheme no
checkpoint ships. Figures: bits per character from ``eval.json`` (``ordinal eval
--save``), wall time and tokens from ``metrics.json``, positional parameters from the weights,
stress and monotonicity from docs/geometry/shakespeare/report.json (``ordinal geometry``). In
each bpc column the best checkpoint is bold.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lab.evaluate import checkpoint_row
from lab.markdown import markdown_table
from model.checkpoint import load_checkpoint
from model.config import preset
from model.positional import SCHEMES
from model.transformer import Transformer

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINTS = ROOT / "checkpoints"
GEOMETRY = ROOT / "docs" / "geometry" / "shakespeare" / "report.json"
README = ROOT / "README.md"
CHECKPOINTS_README = CHECKPOINTS / "README.md"
MULTIPLES = ("1x", "2x", "4x", "8x")

# How each checkpoint's positions enter the model, in a few words (the README's second column).
HOW_IT_ENTERS = {
    "none": "nothing (causal mask only)",
    "integer": "adds p·scale to every dimension",
    "binary": "adds the bits of p",
    "sinusoidal": "adds sin/cos of p",
    "learned": "adds a trained row per position",
    "rope": "rotates queries and keys",
    "alibi": "biases scores by −m·distance (the paper's slopes ×4)",
    "t5": "biases scores by a learned value per distance bucket",
    "mds": "adds fixed P_MDS of the corpus",
    "lowrank": "adds A·Bᵀ (rank 32, trained)",
    "fox": "forget gates: older keys' scores lose the summed log of a learned gate per token",
    "cope": "adds q·e[p], p counting the keys σ(q·k) gates in (contextual positions)",
    "fire": "biases scores by a learned MLP of the log distance over the log query position",
    "irope": "rope in layers 0–2, none in layer 3 (Llama 4's schedule), queries sharpened past "
    "128 there",
    "stickbreaking": "no encoding: each key takes σ(q·k) of what the later keys left "
    "(stick-breaking replaces softmax)",
    "pope": "each component's magnitude softplus(x) at phase p·θ_c, keys' phases shifted by a "
    "learned δ",
    "path": "each key turned by the Householder transitions I − β·w·wᵀ of the tokens after it, "
    "w and β from those tokens",
    "pathfox": "path's transitions and fox's forget gates on the same scores (PaTH-FoX)",
    "prope": "rotates with the fastest 75% of rope's frequencies",
    "drope": "the rope checkpoint with rope removed, recalibrated 480 steps",
}
# Checkpoints trained while other work shared the two cores: their wall time is marked ¹.
CORES_SHARED = frozenset({"irope", "stickbreaking", "pope", "path"})
# bpc at 1× of the previous recipe's checkpoints (v2: 2,000 float32 steps, no average; measured
# by `ordinal eval` on them before they were replaced, commit 2756e52).
V2_BPC = {
    "none": 2.126, "integer": 2.131, "binary": 2.127, "sinusoidal": 2.116, "learned": 2.116,
    "rope": 2.075, "alibi": 2.101, "t5": 2.092, "mds": 2.124, "lowrank": 2.122, "fox": 2.078,
    "fire": 2.078, "cope": 2.057, "prope": 2.078, "drope": 2.221,
}  # fmt: skip
NO_POSITION_ONLY = {
    "data-dependent": "— (data-dependent)",
    "weights": "— (no position-only signal)",
}


def shipped_folders(root: Path = CHECKPOINTS) -> list[Path]:
    """The checkpoint folders, those named after a scheme in the registry's order first."""
    folders = [path for path in root.iterdir() if (path / "eval.json").is_file()]
    order = {name: index for index, name in enumerate(SCHEMES)}
    return sorted(folders, key=lambda path: (order.get(path.name, len(order)), path.name))


class Checkpoint:
    """What the tables say of one checkpoint folder."""

    def __init__(self, folder: Path) -> None:
        self.name = folder.name
        self.config = json.loads((folder / "config.json").read_text())
        self.scheme = self.config["positional"]["scheme"]
        self.eval = json.loads((folder / "eval.json").read_text())
        self.metrics = json.loads((folder / "metrics.json").read_text())
        self.budgets = (
            [self.metrics["init"], self.metrics] if "init" in self.metrics else [self.metrics]
        )

    @property
    def label(self) -> str:
        """README's name: "`prope` (rope, `fraction` 0.75)", "`drope` (none, from rope)"."""
        if self.name == self.scheme:
            return f"`{self.name}`"
        settings = {k: v for k, v in self.config["positional"].items() if k != "scheme"}
        words = [self.scheme, *(f"`{key}` {value}" for key, value in settings.items())]
        if "init" in self.metrics:
            words.append(f"from {Path(self.metrics['init']['checkpoint']).name}")
        return f"`{self.name}` ({', '.join(words)})"

    def bpc(self, multiple: str) -> float | None:
        result = self.eval["results"].get(multiple)
        return result["bpc"] if result and result["supported"] else None

    def wall(self) -> str:
        """README's "8.1 + 1.8 min", marked ¹ where the cores were shared."""
        minutes = " + ".join(f"{budget['wall_seconds'] / 60:.1f}" for budget in self.budgets)
        return f"{minutes} min" + ("¹" if self.name in CORES_SHARED else "")

    def positional_parameters(self) -> str:
        """Trained positional parameters, and stored fixed ones (mds's coordinates)."""
        model, _ = load_checkpoint(CHECKPOINTS / self.name, device="cpu")
        trained = sum(p.numel() for p in model.positional.parameters())
        stored = sum(
            t.numel() for name, t in model.state_dict().items() if name.startswith("positional.")
        )
        return f"{trained:,}" + (f" (+{stored - trained:,} fixed)" if stored > trained else "")


def _best(checkpoints: Sequence[Checkpoint], multiple: str) -> float | None:
    values = [value for c in checkpoints if (value := c.bpc(multiple)) is not None]
    return min(values, default=None)


def _bold_if_best(cell: str, best: float | None) -> str:
    """A bpc ``cell`` ("2.048", "past its table"), bold where it shows the column's best."""
    return f"**{cell}**" if best is not None and cell == f"{best:.3f}" else cell


def _bpc_cell(checkpoint: Checkpoint, multiple: str, best: float | None) -> str:
    value = checkpoint.bpc(multiple)
    return "past its table" if value is None else _bold_if_best(f"{value:.3f}", best)


def _geometry(report: dict[str, Any], checkpoint: Checkpoint) -> tuple[str, str]:
    """(scale-free stress, monotonicity violation rate) of the trained encoding."""
    label = f"{checkpoint.name} ({checkpoint.scheme})"  # how the report names a checkpoint
    for row in report["schemes"]:
        if row["label"] == label:
            return f"{row['scale_free_stress']:.3g}", f"{row['monotonicity_violation_rate']:.2f}"
    kind = SCHEMES[checkpoint.scheme].kind
    if kind in NO_POSITION_ONLY:
        return NO_POSITION_ONLY[kind], "—"
    return "not measured yet", "not measured yet"


def unshipped_row(scheme: str) -> list[str]:
    """README's row of a registered scheme no checkpoint ships (PaTH-FoX): what it is, and its
    positional parameters at the shipped preset's size."""
    model = Transformer(preset("shipped").model_config(scheme))
    parameters = sum(p.numel() for p in model.positional.parameters())
    return [f"`{scheme}`", HOW_IT_ENTERS[scheme], f"{parameters:,}", *["not shipped"] * 7]


def readme_table(checkpoints: Sequence[Checkpoint], report: dict[str, Any]) -> list[str]:
    header = [
        "scheme", "how it enters", "positional parameters",
        "val bpc 1× (128)", "2× (256)", "4× (512)", "8× (1024)", "train wall",
        "scale-free stress vs corpus", "monotonicity violations",
    ]  # fmt: skip
    best = {m: _best(checkpoints, m) for m in MULTIPLES}
    rows = {
        c.name: [
            c.label,
            HOW_IT_ENTERS[c.name],
            c.positional_parameters(),
            *(_bpc_cell(c, m, best[m]) for m in MULTIPLES),
            c.wall(),
            *_geometry(report, c),
        ]
        for c in checkpoints
    }
    # every registered scheme in the registry's order, then the recipes on another scheme
    ordered = [rows.pop(name) if name in rows else unshipped_row(name) for name in SCHEMES]
    return markdown_table(header, [*ordered, *rows.values()])


def results_table(checkpoints: Sequence[Checkpoint]) -> list[str]:
    """checkpoints/README's table: ``ordinal eval --table``'s row of each checkpoint
    (``lab.evaluate.checkpoint_row``), with v2's bpc at 1×, the best of each column bold, and
    a wall time taken beside other work marked so."""
    header = [
        "scheme", "parameters", "training tokens", "train wall time", "bpc at 1x (128 tokens)",
        "v2 at 1x", "bpc at 2x (256 tokens)", "bpc at 4x (512 tokens)", "bpc at 8x (1024 tokens)",
    ]  # fmt: skip
    best = [_best(checkpoints, m) for m in MULTIPLES]
    rows = []
    for c in checkpoints:
        label, parameters, tokens, wall, *bpc = checkpoint_row(c.eval, c.metrics)
        bpc = [_bold_if_best(cell, value) for cell, value in zip(bpc, best, strict=True)]
        v2 = f"{V2_BPC[c.name]:.3f}" if c.name in V2_BPC else "—"
        wall += " (cores shared)" if c.name in CORES_SHARED else ""
        rows.append([label, parameters, tokens, wall, bpc[0], v2, *bpc[1:]])
    return markdown_table(header, rows)


def replace_between_markers(text: str, name: str, lines: list[str]) -> str:
    """``text`` with the lines between ``<!-- scheme table: NAME -->`` and
    ``<!-- end of scheme table -->`` replaced by ``lines``."""
    begin = f"<!-- scheme table: {name} (python -m lab.tables) -->"
    end = "<!-- end of scheme table -->"
    head, found, rest = text.partition(begin)
    if not found or end not in rest:
        raise ValueError(f"no {begin} … {end} in the file")
    _, _, tail = rest.partition(end)
    return head + begin + "\n" + "\n".join(lines) + "\n" + end + tail


def generated() -> dict[Path, str]:
    """Each README's text with its table as the files say it should be."""
    checkpoints = [Checkpoint(folder) for folder in shipped_folders()]
    report = json.loads(GEOMETRY.read_text())
    return {
        README: replace_between_markers(
            README.read_text(), "README", readme_table(checkpoints, report)
        ),
        CHECKPOINTS_README: replace_between_markers(
            CHECKPOINTS_README.read_text(), "checkpoints", results_table(checkpoints)
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.tables", description=__doc__)
    parser.add_argument("--check", action="store_true", help="only say whether they are current")
    args = parser.parse_args(argv)
    stale = {path: text for path, text in generated().items() if path.read_text() != text}
    for path, text in stale.items():
        if args.check:
            print(f"{path.relative_to(ROOT)}: its scheme table is stale (python -m lab.tables)")
        else:
            path.write_text(text)
            print(f"rewrote {path.relative_to(ROOT)}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
