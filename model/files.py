"""Writing files so that a reader sees the old file or the new one, never a part of either.

The checkpoint layout's file names live here too, so that a process reading them (the API
process looks for ``config.json`` and reads ``tokenizer.json``) needs no torch.

So does the one rule of where a command may write (:func:`check_output`): every command that
writes a checkpoint, an export or a report (``train --out``, ``import``, ``export``, ``eval
--plot/--table``, ``geometry --out``) asks it before writing anything, and is refused an OUT
that is or holds what it reads, lies inside a model folder or holds one, or is occupied by
something that is not an earlier output of its own kind (unless ``--force``).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """Write JSON to ``path`` via a temp file in the same folder and os.replace."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder and os.replace."""
    write_atomic(path, lambda staging: staging.write_text(text))


def write_figure_atomic(path: str | os.PathLike[str], figure: Any, dpi: int = 100) -> None:
    """Save a matplotlib figure as PNG at ``path``, atomically (the staging name ends in
    ``.tmp``, so the format is given rather than guessed from it)."""
    write_atomic(path, lambda staging: figure.savefig(staging, format="png", dpi=dpi))


def write_atomic(path: str | os.PathLike[str], write: Callable[[Path], object]) -> None:
    """``write(staging)`` writes the file's content to ``staging`` (a temp file beside ``path``),
    which then replaces ``path`` at once: readers see the old file or the new one, never a part.
    Any writer that takes a path fits (``torch.save``, ``Figure.savefig``, ...)."""
    with atomic_path(path) as staging:
        write(staging)


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temp path in ``path``'s folder; when the block ends without error it replaces ``path``
    (readable by all: checkpoints are shared read-only); on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    staging = Path(name)
    try:
        yield staging
        os.chmod(staging, 0o644)  # mkstemp makes it private
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------------------------
# Where a command may write: the one rule for every OUT

EVAL_FILE = "eval.json"  # ``ordinal eval --save``: the scores of the weights beside it
METRICS_FILE = "metrics.json"  # ``ordinal train``: the curves and budget of the run that made them
# What a checkpoint folder says about its own weights: never carried into a new model's folder.
WEIGHTS_RECORDS = (EVAL_FILE, METRICS_FILE)
# The files every model folder holds, a checkpoint and an exported Hugging Face folder alike.
MODEL_FILES = (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE)


class OutputError(ValueError):
    """A command's OUT is refused: writing there could destroy files the command did not make."""


@dataclass(frozen=True)
class OutputKind:
    """What a command writes at its OUT (a folder or a file), and how an earlier one is told:
    ``earlier(path)`` is None when the existing ``path`` is such an output, so writing the new
    one there loses nothing else, else why it is not (e.g. "it holds notes.txt")."""

    name: str  # as a message says it: "a checkpoint", "a GGUF file", ...
    folder: bool
    earlier: Callable[[Path], str | None]


def is_model_folder(path: Path) -> bool:
    """Whether ``path`` holds a model: a checkpoint or an export (both have these three files)."""
    return all((path / name).is_file() for name in MODEL_FILES)


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None where it is unreadable or something else."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def not_a_checkpoint(path: Path) -> str | None:
    """Why ``path`` is not an ordinal checkpoint folder, or None when it is one."""
    if not path.is_dir():
        return "a file"
    missing = [name for name in MODEL_FILES if not (path / name).is_file()]
    if missing:
        return f"it has no {missing[0]}"
    config = read_json_object(path / CONFIG_FILE)
    # A Hugging Face folder's config.json names its architectures; a checkpoint's, its scheme.
    if config is None or "positional" not in config or "architectures" in config:
        return f"its {CONFIG_FILE} is not an ordinal checkpoint's"
    return None


def only_files(path: Path, names: Collection[str]) -> str | None:
    """Why the folder ``path`` holds more than files named in ``names``, or None: what a
    command that rewrites the whole folder may replace without losing anything."""
    if not path.is_dir():
        return "a file"
    for entry in sorted(path.iterdir()):
        if entry.name not in names or not entry.is_file() or entry.is_symlink():
            return f"it holds {entry.name}, which this command does not write"
    return None


# Written by ``ordinal train --out`` and ``ordinal import``. Files a user added beside a
# checkpoint's are carried into the new one (never eval.json or metrics.json), so any
# checkpoint may be written again.
CHECKPOINT = OutputKind("a checkpoint", folder=True, earlier=not_a_checkpoint)


def check_output(
    out: str | os.PathLike[str],
    kind: OutputKind,
    *,
    sources: Iterable[str | os.PathLike[str] | None] = (),
    kept: Iterable[str | os.PathLike[str] | None] = (),
    force: bool = False,
) -> bool:
    """The rule every command that writes a checkpoint, an export or a report follows before it
    writes anything at ``out`` (then written beside it and swapped in whole: ``atomic_path``,
    ``model.checkpoint.staged_folder``). Returns whether ``out`` holds an output it replaces.

    Refused with an :class:`OutputError`, whatever ``force`` says:

    - ``out`` is, is inside, or holds one of ``sources`` (what the command reads: the
      checkpoint exported, the folder imported, training's data and tokenizer);
    - ``out`` is or holds one of ``kept`` (folders the command keeps, which ``out`` may lie in:
      training's state folder);
    - ``out`` is inside a model folder (a checkpoint or an export): a GGUF written over
      ``ckpt/rope/model.safetensors`` would replace the checkpoint's own weights;
    - ``out`` holds a model folder (``checkpoints``, every shipped model), or is a checkpoint
      that something other than a checkpoint would replace;
    - ``out`` is a symbolic link (the swap would replace the link, not what it names), or a
      folder where a file is written.

    Refused unless ``force``: ``out`` exists, is not empty, and is not an earlier output of
    ``kind`` (a user's folder or file, an export where a checkpoint goes, ...).
    """
    given = Path(out)
    _refuse_what_it_reads_or_keeps(given, sources, kept)
    target = given.resolve()
    for folder in target.parents:
        if is_model_folder(folder):
            raise OutputError(
                f"OUT {given} is inside the model folder {folder}: writing there would change "
                "that model (write elsewhere)"
            )
    if given.is_symlink():
        raise OutputError(f"OUT {given} is a symbolic link: give the path it names instead")
    if not target.exists() or (target.is_file() and target.stat().st_size == 0):
        return False
    if target.is_dir():
        if not any(target.iterdir()):
            return False
        _refuse_a_folder_it_would_destroy(given, target, kind)
    why_not = kind.earlier(target)
    if why_not is None or force:
        return True
    raise OutputError(
        f"OUT {given} exists and is not {kind.name} ({why_not}): choose another OUT, or pass "
        "--force to replace it"
    )


def _refuse_what_it_reads_or_keeps(
    given: Path,
    sources: Iterable[str | os.PathLike[str] | None],
    kept: Iterable[str | os.PathLike[str] | None],
) -> None:
    """check_output's first rules: OUT is, is inside or holds a source; OUT is or holds a kept
    folder (None: an option not given)."""
    target = given.resolve()
    for folder in kept:
        if folder is not None and Path(folder).resolve().is_relative_to(target):
            raise OutputError(
                f"OUT {given} holds {folder}, which this command keeps: replacing OUT would "
                "delete it"
            )
    for source in sources:
        if source is None:
            continue
        read = Path(source).resolve()
        if target == read:
            raise OutputError(f"OUT {given} is what this command reads: write elsewhere")
        if target.is_relative_to(read):
            raise OutputError(
                f"OUT {given} is inside {source}, which this command reads: write elsewhere"
            )
        if read.is_relative_to(target):
            raise OutputError(
                f"OUT {given} holds {source}, which this command reads: replacing OUT would "
                "delete it"
            )


def _refuse_a_folder_it_would_destroy(given: Path, target: Path, kind: OutputKind) -> None:
    """check_output's rules for a non-empty folder at OUT: a file goes there, it holds a model
    folder, or it is a checkpoint that something else would replace."""
    if not kind.folder:
        raise OutputError(f"OUT {given} is a folder: give the path of {kind.name}")
    for entry in sorted(target.iterdir()):
        if entry.is_dir() and is_model_folder(entry):
            raise OutputError(
                f"OUT {given} holds the model folder {entry}: replacing OUT would delete it "
                "(write elsewhere)"
            )
    if kind is not CHECKPOINT and not_a_checkpoint(target) is None:
        raise OutputError(
            f"OUT {given} is a checkpoint: {kind.name} written there would replace it "
            "(write elsewhere)"
        )
