"""``ordinal eval``: validation loss, bits per character and loss by position at 1×, 2×, 4×.

Every validation token is scored exactly once, in back-to-back windows of m × context_length
tokens that each start with <|bos|> at a speech, or where a speech longer than a window left
off (``lab.data.ValidationStream``). Bits per character divide the total negative
log-likelihood by ln 2 × the characters those tokens stand for, so models with different
tokenizers compare fairly. A scheme whose table ends before a window does is reported as
unsupported at that length, with the reason, rather than crashed.

Loss by position averages every position over the same windows. A scoring window holds whole
speeches while they fit, so its room after the last one would be padding, and only the few
windows filled nearly to the end would reach the last positions — mostly with a speech's final
tokens and its <|eos|>, which are easy, so every curve fell over its last positions
(checkpoints/README.md has the numbers). So the padding is replaced by the text that follows, as
training sequences run on past a speech's end (``running_windows``): the model is causal, so no
scored token's loss changes, and every window that does not run off the end of the stream has a
target at every position.

``--plot`` and ``--table`` are written where ``model.files.check_output`` allows (never inside a
checkpoint; over a file that is not such a plot or table only with ``--force``). Nothing is
written into a checkpoint unless asked (``--save``), and then eval.json is left
byte-identical when it was made from the same weights and the new figures agree with it to
float rounding (threads and batch sizes change the last bits of a sum). Each eval.json records
``weights_sha256``, the SHA-256 of the tensors in model.safetensors (its data section, the same
digest the file's metadata holds), which ``--reuse`` compares: content, not file times, which a
``git clone`` does not keep. The options are ``ordinal eval``'s (ordinal.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from lab.corpus import load_corpus
from lab.curves import checkpoint_label, series_colour
from lab.data import IGNORE_INDEX, ValidationStream, validation_stream
from lab.markdown import markdown_table
from lab.text_corpus import open_text_corpus
from model.checkpoint import WEIGHTS_FILE, data_digest, load_checkpoint
from model.device import resolve_device
from model.files import (
    CONFIG_FILE,
    EVAL_FILE,
    OutputKind,
    check_output,
    write_figure_atomic,
    write_json_atomic,
    write_text_atomic,
)
from model.transformer import Transformer

RopeVariant = tuple[str, str, float]  # ("yarn4", "yarn", 4.0): name, rope scaling, its factor
MULTIPLES = (1, 2, 4)
# Relative difference under which a new figure counts as the saved one (float rounding).
SAME_FIGURE = 1e-6


@torch.no_grad()
def token_losses(
    model: Transformer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    batch_size: int = 16,
    progress: tqdm | None = None,
) -> torch.Tensor:
    """Per-token negative log-likelihood in nats → [N, W] (0 where the target is ignored).

    ``progress``, when given, advances by one per window scored.
    """
    device = model.token_embedding.weight.device
    losses = []
    for start in range(0, len(inputs), batch_size):
        if progress is not None:
            progress.update(len(inputs[start : start + batch_size]))
        logits = model(inputs[start : start + batch_size].to(device)).float()
        chunk_targets = targets[start : start + batch_size].to(device)
        losses.append(
            F.cross_entropy(
                logits.transpose(1, 2), chunk_targets, ignore_index=IGNORE_INDEX, reduction="none"
            ).cpu()
        )
    return torch.cat(losses)


def score_windows(
    model: Transformer,
    stream: ValidationStream,
    window: int,
    batch_size: int = 16,
    progress: tqdm | None = None,
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
    padded_inputs, targets = stream.windows(window)
    inputs, running = running_windows(stream, padded_inputs, targets)
    losses = token_losses(model, inputs, running, batch_size, progress)
    scored = targets != IGNORE_INDEX  # each validation token once: the bpc
    total = float(losses[scored].sum())
    full = (running != IGNORE_INDEX).all(dim=1)  # the windows behind every point of the curve
    if not full.any():
        raise ValueError(
            f"the validation stream ({len(stream.tokens)} tokens) is shorter than one "
            f"{window}-token window"
        )
    return {
        "window": window,
        "supported": True,
        "tokens": int(scored.sum()),
        "loss": total / int(scored.sum()),
        "bpc": total / (math.log(2) * stream.characters),
        "position_windows": int(full.sum()),
        "loss_by_position": [round(value, 4) for value in losses[full].mean(0).tolist()],
    }


def running_windows(
    stream: ValidationStream, inputs: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``stream.windows`` with each window's padding replaced by the text that follows it →
    inputs, targets [N, W]: row r is [bos] + the stream from its first scored token on, as a
    training sequence runs on past the end of its speech.

    The windows' scored tokens are back-to-back chunks of the stream, so row r starts at the
    number of tokens the rows before it score. Past the end of the stream a row keeps its
    padding (target IGNORE_INDEX): those rows are left out of the loss by position.
    """
    scored = targets != IGNORE_INDEX
    counts = scored.sum(dim=1)
    offsets = (counts.cumsum(0) - counts).unsqueeze(1) + torch.arange(targets.shape[1])  # [N, W]
    inside = offsets < len(stream.tokens)
    running = stream.tokens[offsets.clamp(max=len(stream.tokens) - 1)].masked_fill(
        ~inside, IGNORE_INDEX
    )
    if not torch.equal(running[scored], targets[scored]):
        raise ValueError("the scoring windows are not back-to-back chunks of the stream")
    following = running[:, :-1].masked_fill(~inside[:, :-1], stream.special.pad)
    return torch.cat([inputs[:, :1], following], dim=1), running


def weights_digest(path: Path) -> str:
    """SHA-256 of the tensors in ``path``'s model.safetensors (its data section)."""
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"{path} is not a checkpoint: {WEIGHTS_FILE} is missing")
    with open(weights, "rb") as handle:
        return data_digest(handle)


def evaluate_checkpoint(
    path: Path,
    multiples: list[int],
    device: str = "cpu",
    batch_size: int = 16,
    variant: RopeVariant | None = None,
    data: Path | None = None,
) -> dict[str, Any]:
    """Score one checkpoint on the validation plays (a progress bar on stderr) → its report.

    ``variant`` (name, scaling, factor) scores a rope checkpoint under that context extension,
    on the same weights; the report's scheme is then ``rope+NAME``. ``data`` scores on the
    validation split of that text instead (``--data``, as training held it out).
    """
    digest = weights_digest(path) if (path / WEIGHTS_FILE).is_file() else None
    overrides = None
    if variant is not None:
        overrides = {"scaling": variant[1], "scaling_factor": variant[2]}
    model, tokenizer = load_checkpoint(
        path, device=resolve_device(device), positional_overrides=overrides
    )
    documents = (
        load_corpus().validation
        if data is None
        else open_text_corpus(data).documents_of("validation")  # not the training text
    )
    stream = validation_stream(tokenizer, documents)
    context = model.config.context_length
    limit = model.positional.max_positions
    windows = sum(
        len(stream.windows(m * context)[0])
        for m in multiples
        if limit is None or m * context <= limit
    )
    with tqdm(total=windows, desc=model.config.scheme, unit="window", leave=False) as progress:
        results = {
            f"{m}x": score_windows(model, stream, m * context, batch_size, progress)
            for m in multiples
        }
    return {
        "checkpoint": str(path),
        **({} if data is None else {"data": str(data)}),
        "scheme": model.config.scheme + (f"+{variant[0]}" if variant else ""),
        "weights_sha256": digest,
        "parameters": model.num_parameters(),
        "context_length": context,
        "validation_tokens": len(stream.tokens),
        "validation_characters": stream.characters,
        "loss": results.get("1x", {}).get("loss"),
        "bpc": results.get("1x", {}).get("bpc"),
        "results": results,
    }


def same_results(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether two reports are of the same weights with figures equal to float rounding."""
    if old.get("weights_sha256") != new.get("weights_sha256") or set(old) != set(new):
        return False
    return _close(
        {k: v for k, v in old.items() if k != "checkpoint"},
        {k: v for k, v in new.items() if k != "checkpoint"},
    )


def _close(old: Any, new: Any) -> bool:
    if isinstance(old, dict) and isinstance(new, dict):
        return old.keys() == new.keys() and all(_close(old[k], new[k]) for k in old)
    if isinstance(old, list) and isinstance(new, list):
        return len(old) == len(new) and all(map(_close, old, new))
    if isinstance(old, float) or isinstance(new, float):
        if isinstance(old, bool) or isinstance(new, bool):
            return old == new
        scale = max(abs(old), abs(new), 1e-12)
        return isinstance(old, int | float) and abs(old - new) <= SAME_FIGURE * scale
    return old == new


def saved_report(
    path: Path, multiples: list[int], data: Path | None = None
) -> dict[str, Any] | None:
    """``path``'s eval.json when it was made from these very weights, on the same text, and has
    every multiple, restricted to ``multiples``; None otherwise."""
    saved = path / EVAL_FILE
    if not saved.is_file():
        return None
    try:
        report = json.loads(saved.read_text())
    except json.JSONDecodeError:
        return None
    wanted = [f"{m}x" for m in multiples]
    if report.get("data") != (None if data is None else str(data)):
        return None
    if report.get("weights_sha256") != weights_digest(path) or not set(wanted) <= set(
        report.get("results", {})
    ):
        return None
    if any(r["supported"] and "position_windows" not in r for r in report["results"].values()):
        return None  # its loss by position averaged each position over other windows
    report["results"] = {key: report["results"][key] for key in wanted}
    report["checkpoint"] = str(path)  # where it is now: a folder moved since keeps its report
    return report


def save_report(path: Path, report: dict[str, Any]) -> bool:
    """Write ``report`` as ``path``'s eval.json unless the file already says the same (see
    same_results); True when it was written."""
    saved = path / EVAL_FILE
    if saved.is_file():
        try:
            if same_results(json.loads(saved.read_text()), report):
                return False
        except json.JSONDecodeError:
            pass
    write_json_atomic(saved, report)
    return True


def plot_loss_by_position(reports: list[dict[str, Any]], path: Path) -> None:
    """One curve per checkpoint: its longest supported window, smoothed; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(12, 6))
    lines = 0  # colours follow the lines drawn, not the reports: skipped ones take none
    for report in reports:
        supported = [r for r in report["results"].values() if r["supported"]]
        label = report_label(report)
        variant = "+" in report["scheme"]  # a rope context extension: dashed
        if not supported or (variant and label != report["scheme"]):
            continue  # a renamed rope's variants (prope+yarn4) would crowd out the rest
        longest = max(supported, key=lambda result: result["window"])
        curve = torch.tensor(longest["loss_by_position"])
        smooth = F.avg_pool1d(
            curve.view(1, 1, -1), 9, stride=1, padding=4, count_include_pad=False
        ).view(-1)
        axes.plot(
            range(len(curve)),
            smooth.tolist(),
            label=f"{label} ({longest['position_windows']} windows)",
            linewidth=1.4,
            color=series_colour(lines),
            linestyle="--" if variant else "-",
        )
        lines += 1
    context = reports[0]["context_length"]
    axes.axvline(context, color="grey", linestyle="--", linewidth=1)
    axes.text(context, axes.get_ylim()[1], " training context", va="top", color="grey")
    axes.set_xlabel("position in window (tokens)")
    axes.set_ylabel("validation loss (nats/token, 9-token moving average)")
    axes.set_title(
        "Loss by position on the validation plays\n"
        "every position averaged over the same windows (how many: legend), each starting at a "
        "speech\nand running on past its end into the next, as training sequences do",
        fontsize=10,
    )
    axes.set_ylim(top=min(axes.get_ylim()[1], 8.0))
    axes.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=9)
    figure.tight_layout()
    write_figure_atomic(path, figure, dpi=110)
    plt.close(figure)


def report_label(report: dict[str, Any]) -> str:
    """The checkpoint's name in the table and the plot (``lab.curves.checkpoint_label``)."""
    return checkpoint_label(Path(report["checkpoint"]).name, report["scheme"])


def results_table(reports: list[dict[str, Any]]) -> str:
    """Markdown: scheme, parameters, training tokens and wall time (from metrics.json), bpc.

    A checkpoint whose folder is not named after its scheme is labelled "folder (scheme)"
    (``prope (rope)``); one trained from another (``ordinal train --init``: DroPE) states the
    base's budget, then its own: "8.2 M + 0.4 M"."""
    multiples = list(reports[0]["results"])
    header = ["scheme", "parameters", "training tokens", "train wall time"]
    header += [f"bpc at {m} ({reports[0]['results'][m]['window']} tokens)" for m in multiples]
    rows = []
    for report in reports:
        metrics_path = Path(report["checkpoint"]) / "metrics.json"
        metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
        rows.append(checkpoint_row(report, metrics))
    return "\n".join(markdown_table(header, rows)) + "\n"


def checkpoint_row(report: dict[str, Any], metrics: dict[str, Any]) -> list[str]:
    """One checkpoint's cells of :func:`results_table`: its label, parameters, training tokens
    and wall time (the base's budget first where it was trained from another), then its bpc at
    each multiple, "past its table" where the length is not supported."""
    budgets = [metrics.get("init", {}), metrics] if "init" in metrics else [metrics]
    cells = [
        report_label(report),
        f"{report['parameters']:,}",
        " + ".join(f"{budget.get('tokens_seen', 0) / 1e6:.1f} M" for budget in budgets),
        " + ".join(f"{budget.get('wall_seconds', 0) / 60:.1f} min" for budget in budgets),
    ]
    for result in report["results"].values():
        cells.append(f"{result['bpc']:.3f}" if result["supported"] else "past its table")
    return cells


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"  # the first eight bytes of every PNG
TABLE_START = "| scheme | parameters |"  # the first line of every results_table


def _not_starting_with(start: bytes) -> Callable[[Path], str | None]:
    """Why a file is not one that starts with ``start``, or None."""

    def why_not(path: Path) -> str | None:
        with open(path, "rb") as file:
            return None if file.read(len(start)) == start else f"it does not start {start!r}"

    return why_not


# --plot and --table: a file there is replaced only when it is such a plot or table.
PLOT = OutputKind("a PNG", folder=False, earlier=_not_starting_with(PNG_MAGIC))
TABLE = OutputKind(
    "a results table", folder=False, earlier=_not_starting_with(TABLE_START.encode())
)


def checkpoint_folders(paths: list[Path]) -> list[Path]:
    """The checkpoint folders among ``paths``; files (checkpoints/README.md, a PNG) and folders
    without a config.json (checkpoints/next, which holds checkpoints of its own) are skipped with
    a note on stderr, so ``ordinal eval checkpoints/*`` works. A missing path stays in, to fail
    loudly."""
    folders = []
    for path in paths:
        if path.is_file():
            print(
                f"ordinal eval: skipping {path}: a file, not a checkpoint folder", file=sys.stderr
            )
        elif path.is_dir() and not (path / CONFIG_FILE).is_file():
            print(
                f"ordinal eval: skipping {path}: a folder without {CONFIG_FILE}, not a checkpoint",
                file=sys.stderr,
            )
        else:
            folders.append(path)
    if not folders:
        raise ValueError(f"no checkpoint folders among {', '.join(map(str, paths))}")
    return folders


def _summary(report: dict[str, Any]) -> str:
    """One line: the scheme, then bpc at each length."""
    cells = [
        f"{k}: " + (f"bpc {r['bpc']:.3f}" if r["supported"] else "unsupported")
        for k, r in report["results"].items()
    ]
    return f"{report['scheme']:>10}  " + "  ".join(cells)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``ordinal eval``: score each checkpoint (or reuse its eval.json), print a line per
    checkpoint, then write what was asked: eval.json files, the plot, the table."""
    folders = checkpoint_folders(args.checkpoints)
    read = [*folders, getattr(args, "data", None)]
    force = getattr(args, "force", False)
    for out, kind in ((args.plot, PLOT), (args.table, TABLE)):
        if out is not None:  # checked before any checkpoint is scored, so a refusal is quick
            check_output(out, kind, sources=read, force=force)
    reports = []
    for path in folders:
        data = getattr(args, "data", None)
        report = saved_report(path, args.multiples, data) if args.reuse else None
        reused = report is not None
        if report is None:
            report = evaluate_checkpoint(
                path, args.multiples, args.device, args.batch_size, None, data
            )
        note = ""
        if args.save and not reused:
            note = f"  (wrote {path / EVAL_FILE})" if save_report(path, report) else "  (unchanged)"
        elif reused:
            note = f"  (from {path / EVAL_FILE})"
        print(_summary(report) + note)
        reports.append(report)
        if report["scheme"] == "rope":
            for variant in getattr(args, "rope_variants", []):
                scored = evaluate_checkpoint(
                    path, args.multiples, args.device, args.batch_size, variant, data
                )
                print(_summary(scored))
                reports.append(scored)
    if args.plot:
        plot_loss_by_position(reports, args.plot)
    if args.table:
        write_text_atomic(args.table, results_table(reports))
    return reports
