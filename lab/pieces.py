"""Text in pieces for the tokenizer: any document, however long, as pieces of at most
:data:`PIECE_CHARS` characters that tokenize exactly as the whole does.

Training reads its text as pieces (``Corpus.pieces``, ``lab.text_corpus.TextSource.pieces``)
and encodes them a batch at a time (``lab.data.encode_stream``), so neither a long document
nor a large file is ever held whole. A piece ends where byte-level BPE's pre-tokenizer ends a
word anyway (:func:`cut_pieces`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Literal, NamedTuple, Protocol

PIECE_CHARS = 1 << 16  # the most characters of one piece handed to the tokenizer
CUT_WINDOW = 1 << 13  # how far back from a piece's end a clean cut is looked for

# Where a piece may end: after a line break between two characters that are not whitespace.
# Byte-level BPE's pre-tokenizer (GPT-2's pattern) ends a word on both sides of such a line
# break, so the pieces tokenize exactly as the whole text does.
_CLEAN_CUT = re.compile(r"(?<=\S\n)(?=\S)")
Part = Literal["train", "validation"]


class Piece(NamedTuple):
    """Consecutive text of one document; ``ends_document`` on its last piece."""

    text: str
    ends_document: bool


def cut_pieces(blocks: Iterable[str], size: int | None = None) -> Iterator[str]:
    """One document's text, given in ``blocks`` of any length, as pieces of 1 to ``size``
    characters, in order.

    A piece ends at a clean cut (:data:`_CLEAN_CUT`) in its last :data:`CUT_WINDOW` characters
    where there is one, so pieces tokenize as the whole does; only a stretch of that many
    characters without a line break between words is cut where it is. Holds at most one block
    and one piece at a time. ``size``: :data:`PIECE_CHARS` unless given.
    """
    size = size or PIECE_CHARS
    carry = ""
    for block in blocks:
        text = carry + block
        start = 0
        while len(text) - start > size:
            end = start + size
            # (a cut at ``end`` itself needs the character after it: hence end + 1)
            cuts = list(_CLEAN_CUT.finditer(text, max(start + 1, end - CUT_WINDOW), end + 1))
            cut = cuts[-1].start() if cuts else end
            yield text[start:cut]
            start = cut
        carry = text[start:]
    if carry:
        yield carry


def pieces_of(blocks: Iterable[str], size: int | None = None) -> Iterator[Piece]:
    """One document's pieces (:func:`cut_pieces`), its last one marked (an empty document is
    one empty piece)."""
    pieces = cut_pieces(blocks, size)
    piece = next(pieces, "")
    for following in pieces:
        yield Piece(piece, False)
        piece = following
    yield Piece(piece, True)


def document_pieces(documents: Iterable[str], size: int | None = None) -> Iterator[Piece]:
    """Every document's pieces, in order (:func:`pieces_of`)."""
    for document in documents:
        yield from pieces_of([document], size)


class PieceSource(Protocol):
    """Text a run trains and validates on, read as pieces: the Shakespeare corpus
    (``lab.corpus.Corpus``) or a user's (``lab.text_corpus.TextSource``)."""

    def pieces(self, part: Part) -> Iterator[Piece]:
        """The pieces of every document of ``part``, in order."""
        ...

    def characters_of(self, part: Part) -> int:
        """How many characters ``part`` holds (for progress bars)."""
        ...
