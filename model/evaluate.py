"""``ordinal eval``: validation loss, bits per character and loss by position at 1×, 2×, 4×.

Every validation token is scored exactly once, in back-to-back windows of m × context_length
tokens that each start with <|bos|> (``model.data.ValidationStream``). Bits per character divide
the total negative log-likelihood by ln 2 × the characters those tokens stand for, so models with
different tokenizers compare fairly. A scheme whose table ends before a window does is reported
as unsupported at that length, with the reason, rather than crashed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from model.checkpoint import load_checkpoint
from model.config import write_json_atomic
from model.corpus import load_corpus
from model.data import IGNORE_INDEX, ValidationStream, validation_stream
from model.transformer import Transformer

EVAL_FILE = "eval.json"
MULTIPLES = (1, 2, 4)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``ordinal eval``."""
    parser.add_argument("checkpoints", nargs="+", type=Path, help="checkpoint folders")
    parser.add_argument("--plot", type=Path, help="write a PNG of loss by position to this path")
    parser.add_argument(
        "--multiples",
        type=int,
        nargs="+",
        default=list(MULTIPLES),
        help="window lengths as multiples of the training context (default 1 2 4)",
    )
    parser.add_argument("--table", type=Path, help="write a markdown table of the results here")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="use a checkpoint's eval.json when it is newer than its weights (replot, retable)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=16)


@torch.no_grad()
def token_losses(
    model: Transformer, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int = 16
) -> torch.Tensor:
    """Per-token negative log-likelihood in nats → [N, W] (0 where the target is ignored)."""
    device = model.token_embedding.weight.device
    losses = []
    for start in range(0, len(inputs), batch_size):
        logits = model(inputs[start : start + batch_size].to(device)).float()
        chunk_targets = targets[start : start + batch_size].to(device)
        losses.append(
            F.cross_entropy(
                logits.transpose(1, 2), chunk_targets, ignore_index=IGNORE_INDEX, reduction="none"
            ).cpu()
        )
    return torch.cat(losses)


def score_windows(
    model: Transformer, stream: ValidationStream, window: int, batch_size: int = 16
) -> dict[str, Any]:
    """Loss, bits per character and mean loss at each position for windows of ``window`` tokens."""
    limit = model.positional.max_positions
    if limit is not None and window > limit:
        return {
            "window": window,
            "supported": False,
            "reason": f"the '{model.config.scheme}' scheme has a table of {limit} positions; "
            f"a {window}-token window needs positions up to {window - 1}",
        }
    inputs, targets = stream.windows(window)
    losses = token_losses(model, inputs, targets, batch_size)
    scored = targets != IGNORE_INDEX
    total = float(losses[scored].sum())
    per_position = losses.sum(0) / scored.sum(0).clamp(min=1)
    return {
        "window": window,
        "supported": True,
        "tokens": int(scored.sum()),
        "loss": total / int(scored.sum()),
        "bpc": total / (math.log(2) * stream.characters),
        "loss_by_position": [round(value, 4) for value in per_position.tolist()],
    }


def evaluate_checkpoint(
    path: Path, multiples: list[int], device: str = "cpu", batch_size: int = 16
) -> dict[str, Any]:
    """Score one checkpoint on the validation plays and write eval.json into it."""
    model, tokenizer = load_checkpoint(path, device=device)
    stream = validation_stream(tokenizer, load_corpus().validation)
    context = model.config.context_length
    results = {f"{m}x": score_windows(model, stream, m * context, batch_size) for m in multiples}
    report = {
        "checkpoint": str(path),
        "scheme": model.config.scheme,
        "parameters": model.num_parameters(),
        "context_length": context,
        "validation_tokens": len(stream.tokens),
        "validation_characters": stream.characters,
        "loss": results.get("1x", {}).get("loss"),
        "bpc": results.get("1x", {}).get("bpc"),
        "results": results,
    }
    write_json_atomic(path / EVAL_FILE, report)
    return report


def plot_loss_by_position(reports: list[dict[str, Any]], path: Path) -> None:
    """One curve per checkpoint: its longest supported window, smoothed; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(10, 6))
    for report in reports:
        supported = [r for r in report["results"].values() if r["supported"]]
        if not supported:
            continue
        longest = max(supported, key=lambda result: result["window"])
        curve = torch.tensor(longest["loss_by_position"])
        smooth = F.avg_pool1d(
            curve.view(1, 1, -1), 9, stride=1, padding=4, count_include_pad=False
        ).view(-1)
        axes.plot(range(len(curve)), smooth.tolist(), label=report["scheme"], linewidth=1.4)
    context = reports[0]["context_length"]
    axes.axvline(context, color="grey", linestyle="--", linewidth=1)
    axes.text(context, axes.get_ylim()[1], " training context", va="top", color="grey")
    axes.set_xlabel("position in window (tokens)")
    axes.set_ylabel("validation loss (nats/token, 9-token moving average)")
    axes.set_title("Loss by position on the validation plays")
    axes.set_ylim(top=min(axes.get_ylim()[1], 8.0))
    axes.legend(ncol=2)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".png")
    os.close(fd)
    figure.savefig(tmp, dpi=110)
    plt.close(figure)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def results_table(reports: list[dict[str, Any]]) -> str:
    """Markdown: scheme, parameters, training tokens and wall time (from metrics.json), bpc."""
    multiples = list(reports[0]["results"])
    header = ["scheme", "parameters", "training tokens", "train wall time"]
    header += [f"bpc at {m} ({reports[0]['results'][m]['window']} tokens)" for m in multiples]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for report in reports:
        folder = Path(report["checkpoint"])
        metrics_path = folder / "metrics.json"
        metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
        cells = [
            report["scheme"],
            f"{report['parameters']:,}",
            f"{metrics.get('tokens_seen', 0) / 1e6:.1f} M",
            f"{metrics.get('wall_seconds', 0) / 60:.1f} min",
        ]
        for result in report["results"].values():
            cells.append(f"{result['bpc']:.3f}" if result["supported"] else "past its table")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _newer(path: Path, than: Path) -> bool:
    return than.exists() and path.stat().st_mtime >= than.stat().st_mtime


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    reports = []
    for path in args.checkpoints:
        saved = path / EVAL_FILE
        if args.reuse and saved.exists() and _newer(saved, path / "model.safetensors"):
            report = json.loads(saved.read_text())
        else:
            report = evaluate_checkpoint(path, args.multiples, args.device, args.batch_size)
        cells = [
            f"{k}: " + (f"bpc {r['bpc']:.3f}" if r["supported"] else "unsupported")
            for k, r in report["results"].items()
        ]
        print(f"{report['scheme']:>10}  " + "  ".join(cells))
        reports.append(report)
    if args.plot:
        plot_loss_by_position(reports, args.plot)
    if args.table:
        args.table.write_text(results_table(reports))
    return reports
