"""Writing files so that a reader sees the old file or the new one, never a part of either.

The checkpoint layout's file names live here too, so that a process reading them (the API
process looks for ``config.json`` and reads ``tokenizer.json``) needs no torch.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
