"""Byte-level BPE tokenizer (Hugging Face ``tokenizers``) and the helpers built on it.

Byte-level means every id stands for a run of raw UTF-8 bytes and the 256 single bytes are all
in the vocabulary, so any text encodes and decodes back exactly. One id can hold part of a
multi-byte character; :class:`IncrementalDecoder` deals with that when streaming text out.

A tokenizer in memory adds no special token: ordinal places ``<|bos|>`` itself
(:func:`encode_prompt`, the server's prompts, training data). Its ``tokenizer.json`` does, in a
post-processor (:func:`with_bos`), so that Hugging Face's ``AutoTokenizer`` on a checkpoint folder
encodes a text to the ids the server prompts with; :func:`load_tokenizer` drops it again.

Special tokens (ids 0, 1, 2 in a tokenizer trained here):
``<|bos|>`` begins every sequence, ``<|eos|>`` ends every document (speech), ``<|pad|>`` fills
batches. Text that happens to contain the string ``"<|eos|>"`` encodes as ordinary bytes, so user
input can never inject a control token. A tokenizer brought from elsewhere (``ordinal import``)
names its own: the ``bos_token``, ``eos_token`` and ``pad_token`` of the ``tokenizer_config.json``
beside its tokenizer.json (Hugging Face's file and keys; no pad token: the eos token pads), which
:func:`load_tokenizer` reads into the tokenizer's ``special_tokens``.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from model.files import write_text_atomic

if TYPE_CHECKING:  # torch only for the annotation: the API process tokenizes without it
    from torch import Tensor

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>")
BOS, EOS, PAD = SPECIAL_TOKENS
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # beside tokenizer.json: chat template, specials
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token")  # its keys naming the specials

# The specials plus all 256 bytes must fit; anything above that is learned merges.
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256
# The longest run of characters of one kind (whitespace, or not) that BPE training sees whole:
# the trainer's merge shifts the rest of a word at every merge inside it, so its time grows
# with the square of a word's length (a word of 20,000 letters: 0.26 s; 40,000: 1.1 s; 1 MB
# of "a" never finished). No learned token is that long; longer runs are learned from as
# pieces of this many characters.
MAX_TRAINING_WORD = 256
_LONG_RUN = re.compile(  # such a run, matched from its first character only (linear time)
    rf"(?<!\S)\S{{{MAX_TRAINING_WORD + 1},}}|(?<!\s)\s{{{MAX_TRAINING_WORD + 1},}}"
)
# The most bytes a tokenizer's files may take per token of the model's vocabulary, and beyond
# them (the normaliser, pre-tokenizer, chat template...). Real ones take 27 (GPT-2) to 126
# (Gemma 3) bytes a token in tokenizer.json; a larger file holds more tokens than the model
# has rows for, and parsing it holds the GIL throughout (137 MB, one million added tokens: 12 s
# during which no other thread of the process ran: the engine's decode loop).
MAX_BYTES_PER_TOKEN = 1024
MAX_BYTES_BESIDES = 1 << 20


class TokenizerError(ValueError):
    """A tokenizer file or argument is unusable (missing specials, vocabulary too small, ...)."""


class SpecialIds(NamedTuple):
    bos: int
    eos: int
    pad: int


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> Tokenizer:
    """Train a byte-level BPE tokenizer of ``vocab_size`` ids on ``texts`` (e.g. documents).

    The special tokens get ids 0, 1, 2 and every one of the 256 bytes is in the vocabulary even
    if the texts never use it, so any string can be encoded.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(
            f"vocab_size={vocab_size} is too small: the {len(SPECIAL_TOKENS)} special tokens and "
            f"256 bytes need at least {MIN_VOCAB_SIZE}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(bounded_words(texts), trainer=trainer)
    # Specials are only ever inserted as ids, never recognised in text.
    tokenizer.encode_special_tokens = True
    return tokenizer


def bounded_words(texts: Iterable[str]) -> Iterator[str]:
    """``texts`` with every run of more than :data:`MAX_TRAINING_WORD` characters of one kind
    cut into pieces of that many, each piece a text of its own (the trainer splits words within
    a text only, so a cut anywhere else changes nothing it counts)."""
    for text in texts:
        start = 0
        for run in _LONG_RUN.finditer(text):
            for cut in range(run.start() + MAX_TRAINING_WORD, run.end(), MAX_TRAINING_WORD):
                yield text[start:cut]
                start = cut
        yield text[start:]


def special_ids(tokenizer: Tokenizer) -> SpecialIds:
    """The ids of the begin, end and padding tokens: ``<|bos|>``, ``<|eos|>`` and ``<|pad|>``,
    or those named by the tokenizer's ``special_tokens`` (see :func:`load_tokenizer`)."""
    names = getattr(tokenizer, "special_tokens", SPECIAL_TOKENS)
    ids = [tokenizer.token_to_id(token) for token in names]
    found = [id_ for id_ in ids if id_ is not None]
    if len(found) < len(ids):
        missing = [token for token, id_ in zip(names, ids, strict=True) if id_ is None]
        raise TokenizerError(f"tokenizer lacks the special tokens {missing}")
    return SpecialIds(*found)


def name_special_tokens(tokenizer: Tokenizer, names: tuple[str, str, str]) -> None:
    """Make ``names`` (bos, eos, pad) the tokenizer's specials, in place of ordinal's own."""
    setattr(tokenizer, "special_tokens", names)  # noqa: B010 (no such attribute in the stubs)


def special_token_config(tokenizer: Tokenizer) -> dict[str, str]:
    """The tokenizer_config.json keys that name the tokenizer's specials where they are not
    ordinal's own ({} otherwise), so that :func:`load_tokenizer` finds them again."""
    names = getattr(tokenizer, "special_tokens", None)
    return {} if names is None else dict(zip(SPECIAL_TOKEN_KEYS, names, strict=True))


def special_token_names(tokenizer_config: dict[str, Any]) -> tuple[str, str, str] | None:
    """(bos, eos, pad) as a ``tokenizer_config.json`` names them, or None if it names no bos
    and eos. A token is a string or an object with its ``content`` (Hugging Face's forms)."""
    names = []
    for key in SPECIAL_TOKEN_KEYS:
        value = tokenizer_config.get(key)
        names.append(value.get("content") if isinstance(value, dict) else value)
    bos, eos, pad = names
    if not isinstance(bos, str) or not isinstance(eos, str):
        return None
    return bos, eos, pad if isinstance(pad, str) else eos


def _byte_of_char() -> dict[str, int]:
    """Inverse of the byte-level alphabet: which byte each vocabulary character stands for.

    This is GPT-2's ``bytes_to_unicode`` table, which ``tokenizers`` uses but does not expose:
    printable bytes stand for themselves, the other 68 are shifted to code points 256 and up so
    that no vocabulary entry contains whitespace or control characters.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = [byte for byte in range(256) if byte not in printable]
    table = {chr(byte): byte for byte in printable}
    table.update({chr(256 + n): byte for n, byte in enumerate(shifted)})
    return table


_BYTE_OF_CHAR = _byte_of_char()


def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """The raw bytes each id stands for, indexed by id; special tokens map to ``b""``.

    Joining the bytes of a sequence of ids and decoding them as UTF-8 gives the decoded text.
    """
    added = tokenizer.get_added_tokens_decoder()
    specials = set(special_ids(tokenizer)) | {id_ for id_, token in added.items() if token.special}
    table = [b""] * tokenizer.get_vocab_size()
    for token, id_ in tokenizer.get_vocab().items():
        if id_ in specials:
            continue
        if id_ in added:  # an added token matches its text as written, not byte-level
            table[id_] = token.encode("utf-8")
        elif all(char in _BYTE_OF_CHAR for char in token):
            table[id_] = bytes(_BYTE_OF_CHAR[char] for char in token)
        else:
            raise TokenizerError(
                f"token {token!r} (id {id_}) is not byte-level BPE: ordinal decodes byte-level "
                f"vocabularies only (GPT-2's kind, not SentencePiece's)"
            )
    return table


class IncrementalDecoder:
    """Turns a stream of token ids into text, one piece per id, for streaming responses.

    ``push`` returns only text whose characters are complete: the bytes of a multi-byte
    character split over several ids are held back until the last one arrives. Invalid bytes
    (which a sampled sequence can contain) come out as U+FFFD, never as broken UTF-8.
    """

    def __init__(self, tokenizer: Tokenizer, table: Sequence[bytes] | None = None) -> None:
        # ``table`` is token_bytes(tokenizer) computed once and shared: building it walks the
        # whole vocabulary (~0.1 s for 2048 ids), too slow to repeat for every request served.
        self._bytes = token_bytes(tokenizer) if table is None else table
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (possibly ``""``)."""
        if not 0 <= token_id < len(self._bytes):
            raise TokenizerError(
                f"token_id={token_id} is outside the vocabulary [0, {len(self._bytes)})"
            )
        return self._utf8.decode(self._bytes[token_id])

    def flush(self) -> str:
        """End of stream: return whatever is held back (an unfinished character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


def count_characters(tokenizer: Tokenizer, ids: Sequence[int] | Tensor) -> int:
    """How many characters ``ids`` stand for, the denominator of bits-per-character.

    Ordinary ids count the characters (code points) they decode to. Each ``<|eos|>`` counts as
    ONE character: it stands for the separator between two speeches, which a character-level
    model would also have to predict. ``<|bos|>`` and ``<|pad|>`` count zero: nothing predicts
    them. ``ids``: a list of ints or a 1-D integer tensor.
    """
    if not isinstance(ids, Sequence):  # a tensor
        ids = ids.tolist()
    table = token_bytes(tokenizer)
    text = b"".join(table[id_] for id_ in ids).decode("utf-8", errors="replace")
    eos = special_ids(tokenizer).eos
    return len(text) + sum(1 for id_ in ids if id_ == eos)


def encode_prompt(tokenizer: Tokenizer, prompt: str | Sequence[int]) -> list[int]:
    """Token ids for a prompt: a text gets <|bos|> first, as every training sequence starts;
    token ids are used exactly as given (as vLLM does), so that a client which tokenized the
    text itself (lm-evaluation-harness) scores and counts the tokens it sent, not one more."""
    if not isinstance(prompt, str):
        return list(prompt)
    return [special_ids(tokenizer).bos, *tokenizer.encode(prompt).ids]


class VocabularyTables(NamedTuple):
    """What both server processes compute once per tokenizer: the API to write responses, the
    engine to decode and trace."""

    token_bytes: list[bytes]  # id → raw bytes (specials: b"")
    token_strings: list[str]  # id → the token as logprobs name it (specials by name)
    bos: int
    eos: int


def vocabulary_tables(tokenizer: Tokenizer) -> VocabularyTables:
    """The tables of ``tokenizer``; invalid UTF-8 in a token's text is backslash-escaped."""
    table = token_bytes(tokenizer)
    strings = [piece.decode("utf-8", errors="backslashreplace") for piece in table]
    specials = special_ids(tokenizer)
    for special in specials:
        strings[special] = tokenizer.id_to_token(special) or ""
    return VocabularyTables(table, strings, specials.bos, specials.eos)


def with_bos(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of ``tokenizer`` whose encode starts with its bos token, as ordinal's prompts do
    (a TemplateProcessing post-processor, Hugging Face's way; a pair gets one bos)."""
    copy = Tokenizer.from_str(tokenizer.to_str())
    bos = special_ids(tokenizer).bos
    name = tokenizer.id_to_token(bos) or BOS
    copy.post_processor = processors.TemplateProcessing(
        single=f"{name} $A", pair=f"{name} $A $B:1", special_tokens=[(name, bos)]
    )
    return copy


def save_tokenizer(tokenizer: Tokenizer, path: str | os.PathLike[str]) -> None:
    """Write the tokenizer as JSON to ``path`` atomically, with its bos post-processor
    (:func:`with_bos`)."""
    write_text_atomic(path, with_bos(tokenizer).to_str(pretty=True))


def check_tokenizer_size(path: str | os.PathLike[str], vocab_size: int) -> None:
    """A TokenizerError, before anything is parsed, when ``path`` (a tokenizer.json) or the
    tokenizer_config.json beside it is larger than any tokenizer of ``vocab_size`` tokens
    (:data:`MAX_BYTES_PER_TOKEN` a token): a file of tokens the model has no rows for, too
    costly to read only to refuse it. A missing file is left to the reader to report."""
    most = vocab_size * MAX_BYTES_PER_TOKEN + MAX_BYTES_BESIDES
    path = Path(path)
    for file in (path, path.with_name(TOKENIZER_CONFIG_FILE)):
        try:
            size = file.stat().st_size
        except OSError:
            continue
        if size > most:
            raise TokenizerError(
                f"{file} is {size / 1e6:.1f} MB: more than a tokenizer of the model's "
                f"{vocab_size:,} tokens takes (at most {most / 1e6:.1f} MB), so it holds tokens "
                f"the model has no rows for; refused unread"
            )


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Read a tokenizer saved by :func:`save_tokenizer`; checks that the specials are there.

    Where the ``tokenizer_config.json`` beside it names a bos and an eos token, those are the
    specials (``special_tokens``; an imported model's), else ordinal's own. The file's
    post-processor is dropped: ordinal places the bos itself, and once is enough.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as error:  # tokenizers raises a bare Exception on malformed JSON
        raise TokenizerError(f"{path} is not a valid tokenizer file: {error}") from error
    names = special_token_names(_read_json_object(path.with_name(TOKENIZER_CONFIG_FILE)))
    if names is not None:
        name_special_tokens(tokenizer, names)
    special_ids(tokenizer)
    tokenizer.post_processor = None
    # Not part of the saved JSON, so restore it here.
    tokenizer.encode_special_tokens = True
    return tokenizer


def _read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; {} when there is none. A malformed file is the chat
    template's to report (``model.chat``, where the API process reads it), not the tokenizer's."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}
