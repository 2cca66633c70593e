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
validate. :attr:`TextSource.split` says which, in words; training prints it and records it.

The file is streamed, never read whole. :func:`open_text_corpus` reads it once through to check
it (every parse error is a :class:`TextCorpusError` naming the file and the line) and to count
its documents and characters; :meth:`TextSource.pieces` then reads it again, each time it is
asked, as pieces that tokenize exactly as the whole text does (``lab.pieces``). Reading holds
one block of :data:`BLOCK_CHARS` characters and one piece at a time, or one ``.jsonl`` line (at
most :data:`MAX_LINE_CHARS` characters).
:func:`load_text_corpus` joins the pieces into whole documents, for the commands that keep them.
"""

from __future__ import annotations

import codecs
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.corpus import Corpus
from lab.pieces import Part, Piece, pieces_of

VALIDATION_EVERY = 10  # documents 10, 20, 30, ... (counted from 1) validate
VALIDATION_FRACTION = 0.1  # of a single document's characters

BLOCK_CHARS = 1 << 20  # characters read from a text file at a time
MAX_LINE_CHARS = 1 << 25  # the longest .jsonl line (one document, parsed whole)

# A string that Python holds but UTF-8 cannot encode (JSON's "\ud800" escapes make them).
_SURROGATE = re.compile("[\ud800-\udfff]")


class TextCorpusError(ValueError):
    """``--data`` names nothing readable, or no text (names the file and the line)."""


@dataclass(frozen=True)
class TextCorpus(Corpus):
    """Training and validation documents of a user's corpus, whole, and how they were split."""

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


@dataclass(frozen=True)
class TextSource:
    """A ``--data`` path, checked and counted (:func:`open_text_corpus`); its pieces are read
    from the file again each time :meth:`pieces` is asked."""

    path: Path
    documents: dict[str, int]  # by part
    characters: dict[str, int]  # by part
    split: str  # how validation was held out, in words
    cut: int | None  # one document: the character where validation starts

    def pieces(self, part: Part) -> Iterator[Piece]:
        """The pieces (:func:`cut_pieces`) of every document of ``part``, in order."""
        if self.cut is not None:  # one document, split by position
            (text,) = _documents(self.path)
            yield from _split_pieces(text, self.cut, part)
            return
        held_out = _held_out(sum(self.documents.values()))
        for index, text in enumerate(_documents(self.path)):
            if held_out(index) == (part == "validation"):
                yield from pieces_of(text.blocks())

    def characters_of(self, part: Part) -> int:
        return self.characters[part]

    def documents_of(self, part: Part) -> tuple[str, ...]:
        """The documents of ``part``, whole (for the commands that keep them in memory)."""
        return tuple(_joined(self.pieces(part)))

    def metadata(self) -> dict[str, Any]:
        """What a checkpoint records of its data (metrics.json's ``data``)."""
        return {
            "path": str(self.path),
            "documents": dict(self.documents),
            "characters": dict(self.characters),
            "split": self.split,
        }


def open_text_corpus(path: str | Path) -> TextSource:
    """The documents at ``path`` (see the module docstring), read through once: every error
    raised here, and each part's documents and characters counted."""
    path = Path(path)
    count = 0
    every_tenth, others, last = 0, 0, 0  # characters: of documents 10, 20, ...; the rest; the last
    only: _Text | None = None
    for text in _documents(path):
        characters = text.survey()
        count += 1
        if count == 1:
            only = text
        if count % VALIDATION_EVERY == 0:
            every_tenth += characters
        else:
            others += characters
        last = characters
    if count == 0 or only is None:
        raise TextCorpusError(f"{path} holds no text")
    if count == 1:
        length = only.length
        cut = _cut_of_one(only)
        if only.first_text >= cut:
            raise TextCorpusError(f"{path}: too little text to hold some out for validation")
        split = (
            f"one document: its last {VALIDATION_FRACTION:.0%} ({length - cut} of {length} "
            f"characters) held out for validation"
        )
        return TextSource(
            path,
            {"train": 1, "validation": 1},
            {"train": cut, "validation": length - cut},
            split,
            cut,
        )
    if count < VALIDATION_EVERY:
        held_out, validation = 1, last
    else:
        held_out, validation = count // VALIDATION_EVERY, every_tenth
    split = (
        f"{count} documents: every {VALIDATION_EVERY}th held out for validation "
        f"({held_out}; the last one when there are fewer than {VALIDATION_EVERY})"
    )
    total = every_tenth + others
    return TextSource(
        path,
        {"train": count - held_out, "validation": held_out},
        {"train": total - validation, "validation": validation},
        split,
        None,
    )


def load_text_corpus(path: str | Path) -> TextCorpus:
    """The documents at ``path``, whole, split into train and validation (for the commands
    that keep every document in memory: ``eval`` and ``geometry``)."""
    source = open_text_corpus(path)
    train, validation = source.documents_of("train"), source.documents_of("validation")
    return TextCorpus(train, validation, str(path), source.split)


def read_documents(path: Path) -> list[str]:
    """Every document at ``path``, whole, in order (blank ones included)."""
    return ["".join(text.blocks()) for text in _documents(path, keep_blank=True)]


# ----------------------------------------------------------------------------------------------
# Reading


class _Text:
    """One document: a whole text file, or the text of one ``.jsonl`` line."""

    def __init__(self, path: Path, text: str | None = None) -> None:
        self.path = path
        self._text = text  # a .jsonl line's, parsed
        self.length = 0  # characters, once surveyed
        self.first_text = 0  # where the first character that is not whitespace is

    def blocks(self) -> Iterator[str]:
        """The document's text in blocks of at most :data:`BLOCK_CHARS` characters (a
        ``.jsonl`` line's text, parsed already, in one)."""
        if self._text is not None:
            yield self._text
            return
        try:
            with open(self.path, encoding="utf-8") as file:  # universal newlines, as read_text
                while block := file.read(BLOCK_CHARS):
                    yield block
        except UnicodeDecodeError:
            raise _not_utf8(self.path) from None

    def survey(self) -> int:
        """Count the characters and find the first one that is not whitespace; → the count."""
        found = False
        for block in self.blocks():
            if not found and (match := re.search(r"\S", block)):
                self.first_text, found = self.length + match.start(), True
            self.length += len(block)
        return self.length

    def has_text(self) -> bool:
        """Whether anything but whitespace is in it (reads at most until it finds some)."""
        return any(not block.isspace() for block in self.blocks())


def _documents(path: Path, keep_blank: bool = False) -> Iterator[_Text]:
    """Every document at ``path`` that holds more than whitespace (all with ``keep_blank``)."""
    if path.is_dir():
        files = sorted(file for file in path.rglob("*.txt") if file.is_file())
        if not files:
            raise TextCorpusError(f"{path} is a folder without .txt files")
        texts: Iterable[_Text] = (_Text(file) for file in files)
    elif not path.is_file():
        raise TextCorpusError(f"{path} does not exist (give a text file, a folder or .jsonl)")
    elif path.suffix == ".jsonl":
        texts = _jsonl_texts(path)
    else:
        texts = [_Text(path)]
    for text in texts:
        if keep_blank or text.has_text():
            yield text


def _jsonl_texts(path: Path) -> Iterator[_Text]:
    """The ``text`` of every line of a ``.jsonl`` file that is not blank, a line at a time."""
    try:
        with open(path, encoding="utf-8") as file:
            number = 0
            while line := file.readline(MAX_LINE_CHARS + 1):
                number += 1
                if len(line) > MAX_LINE_CHARS:
                    raise TextCorpusError(
                        f"{path}, line {number}: longer than {MAX_LINE_CHARS:,} characters (a "
                        f"document that long: give it as a .txt file)"
                    )
                if line.strip():
                    yield _Text(path, _text_field(path, number, line))
    except UnicodeDecodeError:
        raise _not_utf8(path) from None


def _text_field(path: Path, number: int, line: str) -> str:
    """The ``text`` string of the JSON object on line ``number``."""
    try:
        record = json.loads(line)
    except RecursionError:  # json's parser recurses once per level of nesting
        raise TextCorpusError(f"{path}, line {number}: not JSON (nested too deeply)") from None
    except ValueError as error:  # JSONDecodeError, or an integer of too many digits
        raise TextCorpusError(f"{path}, line {number}: not JSON ({error})") from None
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise TextCorpusError(f'{path}, line {number}: no "text" string field')
    if _SURROGATE.search(text):
        raise TextCorpusError(
            f'{path}, line {number}: "text" holds a lone surrogate (a \\ud800-\\udfff escape '
            "that is not half of a pair): not text"
        )
    return text


def _not_utf8(path: Path) -> TextCorpusError:
    """The error for a file that is not UTF-8: its first bad byte, and that byte's line."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    line, offset = 1, 0  # of the first byte of ``raw``
    with open(path, "rb") as file:
        while True:
            raw = file.read(BLOCK_CHARS)
            held = len(decoder.getstate()[0])  # bytes of a character the last block began
            try:
                decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as error:
                at = offset - held + error.start  # in the file
                line += raw.count(b"\n", 0, max(0, at - offset))
                return TextCorpusError(
                    f"{path}, line {line}: not UTF-8 text ({error.reason} at byte {at})"
                )
            if not raw:
                return TextCorpusError(f"{path}: not UTF-8 text")  # (it changed since)
            line += raw.count(b"\n")
            offset += len(raw)


# ----------------------------------------------------------------------------------------------
# The split


def _held_out(count: int) -> Callable[[int], bool]:
    """Whether document ``index`` (of ``count``) validates: every 10th, or the last of fewer."""
    if count < VALIDATION_EVERY:
        return lambda index: index == count - 1
    return lambda index: (index + 1) % VALIDATION_EVERY == 0


def _cut_of_one(text: _Text) -> int:
    """Where a single document's validation starts: about its last VALIDATION_FRACTION,
    starting after the line break nearest before that point (if it is not too far back)."""
    length = text.length
    cut = length - max(1, math.ceil(length * VALIDATION_FRACTION))
    line_start, offset = 0, 0  # after the last line break before the cut, so far
    for block in text.blocks():
        if offset >= cut:
            break
        found = block.rfind("\n", 0, cut - offset)
        if found >= 0:
            line_start = offset + found + 1
        offset += len(block)
    if line_start > 0 and length - line_start <= 2 * (length - cut):
        return line_start
    return cut


def _split_pieces(text: _Text, cut: int, part: Part) -> Iterator[Piece]:
    """The pieces of one document before character ``cut`` (train) or from it (validation)."""
    return pieces_of(_sliced_blocks(text, cut, part))


def _sliced_blocks(text: _Text, cut: int, part: Part) -> Iterator[str]:
    """The blocks of ``text`` cut to its characters before ``cut`` (train) or from it on."""
    offset = 0
    for block in text.blocks():
        low, offset = offset, offset + len(block)
        if part == "train":
            if low >= cut:
                return
            yield block[: cut - low]
        elif offset > cut:
            yield block[max(0, cut - low) :]


def _joined(pieces: Iterable[Piece]) -> Iterator[str]:
    """Whole documents from their pieces."""
    parts: list[str] = []
    for piece in pieces:
        parts.append(piece.text)
        if piece.ends_document:
            yield "".join(parts)
            parts = []
