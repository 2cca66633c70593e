"""Your own text as a corpus: ``--data PATH`` of ``ordinal train``, ``eval`` and ``geometry``.

``PATH`` is one of:

- a text file (``.txt`` or any other name but ``.jsonl``): one document;
- a folder: every ``*.txt`` file in it (sorted by name, subfolders included) is a document;
- a ``.jsonl`` file: every line is a JSON object whose ``text`` field is a document.

Documents are what the model is trained to end with ``<|eos|>`` and what training sequences
start at (the Shakespeare corpus's speeches). The validation split is held out by document:
every :data:`VALIDATION_EVERY`-th document (at least one, the last, when there are fewer),
so no validation text is seen in training. A single document is split by position instead:
its last :data:`VALIDATION_FRACTION` of the characters (cut at a line break where there is one)
validate. :attr:`TextCorpus.split` says which, in words; training prints it and records it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.corpus import Corpus

VALIDATION_EVERY = 10  # documents 10, 20, 30, ... (counted from 1) validate
VALIDATION_FRACTION = 0.1  # of a single document's characters


class TextCorpusError(ValueError):
    """``--data`` names nothing readable, or no text (names the file and the line)."""


@dataclass(frozen=True)
class TextCorpus(Corpus):
    """Training and validation documents of a user's corpus, and how they were split."""

    source: str  # the path as given
    split: str  # how validation was held out, in words

    def metadata(self) -> dict[str, Any]:
        """What a checkpoint records of its data (metrics.json's ``data``)."""
        return {
            "path": self.source,
            "documents": {"train": len(self.train), "validation": len(self.validation)},
            "characters": {
                "train": sum(map(len, self.train)),
                "validation": sum(map(len, self.validation)),
            },
            "split": self.split,
        }


def load_text_corpus(path: str | Path) -> TextCorpus:
    """The documents at ``path`` (see the module docstring), split into train and validation."""
    documents = [text for text in read_documents(Path(path)) if text.strip()]
    if not documents:
        raise TextCorpusError(f"{path} holds no text")
    if len(documents) == 1:
        head, tail = _split_one(documents[0])
        if not head.strip():
            raise TextCorpusError(f"{path}: too little text to hold some out for validation")
        split = (
            f"one document: its last {VALIDATION_FRACTION:.0%} ({len(tail)} of "
            f"{len(documents[0])} characters) held out for validation"
        )
        return TextCorpus((head,), (tail,), str(path), split)
    if len(documents) < VALIDATION_EVERY:
        held_out = {len(documents) - 1}
    else:
        held_out = {i for i in range(len(documents)) if (i + 1) % VALIDATION_EVERY == 0}
    train = tuple(doc for index, doc in enumerate(documents) if index not in held_out)
    validation = tuple(documents[index] for index in sorted(held_out))
    split = (
        f"{len(documents)} documents: every {VALIDATION_EVERY}th held out for validation "
        f"({len(validation)}; the last one when there are fewer than {VALIDATION_EVERY})"
    )
    return TextCorpus(train, validation, str(path), split)


def read_documents(path: Path) -> list[str]:
    """Every document at ``path``, in order."""
    if path.is_dir():
        files = sorted(file for file in path.rglob("*.txt") if file.is_file())
        if not files:
            raise TextCorpusError(f"{path} is a folder without .txt files")
        return [_read_text(file) for file in files]
    if not path.is_file():
        raise TextCorpusError(f"{path} does not exist (give a text file, a folder or .jsonl)")
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    return [_read_text(path)]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise TextCorpusError(f"{path} is not UTF-8 text: {error}") from None


def _read_jsonl(path: Path) -> list[str]:
    documents = []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise TextCorpusError(f"{path}, line {number}: not JSON ({error})") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise TextCorpusError(f'{path}, line {number}: no "text" string field')
        documents.append(text)
    return documents


def _split_one(document: str) -> tuple[str, str]:
    """(train, validation) of one document: validation is about its last VALIDATION_FRACTION,
    starting after the line break nearest before that point (if any)."""
    cut = len(document) - max(1, math.ceil(len(document) * VALIDATION_FRACTION))
    line_start = document.rfind("\n", 0, cut) + 1
    if line_start > 0 and len(document) - line_start <= 2 * (len(document) - cut):
        cut = line_start
    return document[:cut], document[cut:]
