"""Token sequences for training, validation and positional statistics.

Validation windows and the sequences the positional statistics are measured on
(:func:`boundary_sequences`) start at a document (speech) boundary, so position i means "the
i-th token after the start of a speech" — the premise of the positional-geometry analysis.
Training sequences do too by default; they may also start at any line of a speech
(``TrainingSequences(..., line_breaks=...)``), which gives many more distinct sequences.

Layout of the token stream: ``doc_0 + [eos] + doc_1 + [eos] + ...``. A training sample starting
at document i is ``[bos] + stream[start_i : start_i + context_length]``; inputs are all but its
last token and targets all but its first, so the model predicts every token, ``<|eos|>`` included.

Training encodes its text with :func:`encode_stream`: pieces (``lab.pieces``) a batch of
:data:`ENCODE_BATCH_CHARS` characters at a time, with a progress bar. Besides the stream itself
(2 bytes a token for a vocabulary of at most 32,768 ids, else 4, written in place) it holds one
batch: its text, the tokenizer's encodings of it and their ids as Python lists, about 120 bytes
a character of the batch (30 MB measured, with the blocks the text is read in), however large
the file.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from lab.pieces import Piece
from model.tokenizer import SpecialIds, count_characters, special_ids

# Targets with this value are skipped by torch.nn.functional.cross_entropy (its default).
IGNORE_INDEX = -100

# Seeds of successive epochs are spread out so that runs with nearby seeds share no epoch order.
_EPOCH_SEED_STRIDE = 1_000_003
# Characters of text encoded in one call: four pieces, which the tokenizer spreads over its
# threads (a batch of 1 MiB was no faster on two cores, and held 45 MB more while encoded).
ENCODE_BATCH_CHARS = 1 << 18
_SCAN_TOKENS = 1 << 20  # tokens looked through at a time for line breaks


class DataError(ValueError):
    """An argument to the sequence builders is out of range (names the argument)."""


def _require_positive(name: str, value: int) -> None:
    if value < 1:
        raise DataError(f"{name} must be at least 1, got {value}")


def encode_documents(tokenizer: Tokenizer, documents: Iterable[str]) -> list[list[int]]:
    """Token ids of each document, without special tokens (batch-encoded in Rust threads)."""
    encodings = tokenizer.encode_batch_fast(list(documents), add_special_tokens=False)
    return [encoding.ids for encoding in encodings]


class TokenStream(NamedTuple):
    """Documents encoded and laid out as training reads them."""

    tokens: torch.Tensor  # [L] integer: doc_0 + [eos] + doc_1 + [eos] + ...
    starts: torch.Tensor  # [D] long: the offset of each document in ``tokens``


Documents = Sequence[Sequence[int]] | TokenStream  # token ids of each document, or laid out


def _document_stream(documents: Documents, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat stream ``doc_0 + [eos] + doc_1 + [eos] + ...`` [L] and the doc offsets [D]."""
    if isinstance(documents, TokenStream):
        if not len(documents.starts):
            raise DataError("documents is empty")
        return documents
    if not documents:
        raise DataError("documents is empty")
    lengths = torch.tensor([len(document) + 1 for document in documents])
    starts = torch.cumsum(lengths, dim=0) - lengths
    flat = itertools.chain.from_iterable((*document, eos) for document in documents)
    stream = torch.from_numpy(np.fromiter(flat, dtype=np.int64, count=int(lengths.sum())))
    return stream, starts


def encode_stream(
    tokenizer: Tokenizer,
    pieces: Iterable[Piece],
    *,
    characters: int | None = None,
    progress: str | None = None,
    enough: int | None = None,
) -> TokenStream:
    """The documents of ``pieces`` encoded into one stream, a batch of pieces at a time.

    ``progress``: a tqdm bar of that name on stderr, over ``characters`` (the pieces' total).
    ``enough``: stop after the batch that brings the stream to that many tokens (the last
    document may then be cut short, without its ``<|eos|>``).
    """
    eos = special_ids(tokenizer).eos
    dtype = np.int16 if tokenizer.get_vocab_size() <= 1 << 15 else np.int32
    # No more tokens than UTF-8 bytes (byte-level BPE), at most 4 a character: room for that
    # many is reserved, but only the pages written become resident, and the stream is never
    # copied to be joined (which doubled its memory at the end).
    tokens = _Ids(dtype, 4 * characters if characters is not None else ENCODE_BATCH_CHARS)
    starts: list[np.ndarray] = []  # the offsets of the documents begun so far, a batch each
    document_begins = True
    batch: list[Piece] = []
    bar = tqdm(
        total=characters,
        desc=progress,
        unit="char",
        unit_scale=True,
        disable=progress is None,
        mininterval=1.0,
    )

    def encode() -> None:
        nonlocal document_begins
        encodings = tokenizer.encode_batch_fast(
            [piece.text for piece in batch], add_special_tokens=False
        )
        begun = []
        for piece, encoding in zip(batch, encodings, strict=True):
            if document_begins:
                begun.append(tokens.length)
            tokens.extend(encoding.ids)
            document_begins = piece.ends_document
            if document_begins:
                tokens.extend([eos])
        starts.append(np.array(begun, dtype=np.int64))
        bar.update(sum(len(piece.text) for piece in batch))
        batch.clear()

    with bar:
        batch_characters = 0
        for piece in pieces:
            batch.append(piece)
            batch_characters += len(piece.text)
            if batch_characters >= ENCODE_BATCH_CHARS:
                encode()
                batch_characters = 0
                if enough is not None and tokens.length >= enough:
                    break
        if batch:
            encode()
    offsets = np.concatenate(starts) if starts else np.empty(0, dtype=np.int64)
    return TokenStream(torch.from_numpy(tokens.written()), torch.from_numpy(offsets))


class _Ids:
    """Token ids written one batch after another into room reserved ahead (grown, by copying,
    only past it)."""

    def __init__(self, dtype: type[np.integer], reserve: int) -> None:
        self._array = np.empty(max(reserve, 1), dtype=dtype)  # untouched: not resident
        self.length = 0

    def extend(self, ids: Sequence[int]) -> None:
        end = self.length + len(ids)
        if end > len(self._array):
            grown = np.empty(max(end, 2 * len(self._array)), dtype=self._array.dtype)
            grown[: self.length] = self._array[: self.length]
            self._array = grown
        self._array[self.length : end] = ids
        self.length = end

    def written(self) -> np.ndarray:
        """The ids so far (a view: the reserved room past them stays unwritten)."""
        return self._array[: self.length]


def line_break_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of the tokens whose text holds a newline: a line of a speech starts after one."""
    return frozenset(
        token for token in range(tokenizer.get_vocab_size()) if "\n" in tokenizer.decode([token])
    )


def _line_starts(
    stream: torch.Tensor, document_starts: torch.Tensor, line_breaks: Collection[int]
) -> torch.Tensor:
    """Offsets [S] of every document start and every token that follows a line break inside a
    document (never the ``<|eos|>`` ending one, which the next document's start covers)."""
    # Which ids are line breaks, as a table to look them up in; and the stream looked through
    # a slice at a time. A mask of the whole stream, torch.isin's temporaries and a sort to
    # merge the document starts in took 300 MB beside a 130 M-token stream.
    is_break = torch.zeros(
        max([int(stream.max()) + 1, *(b + 1 for b in line_breaks)]), dtype=torch.bool
    )
    is_break[sorted(line_breaks)] = True
    found = []
    for start in range(0, len(stream), _SCAN_TOKENS):
        end = min(start + _SCAN_TOKENS, len(stream))
        starts_here = torch.zeros(end - start, dtype=torch.bool)
        after = max(start, 1)  # positions whose previous token is in the stream
        starts_here[after - start :] = is_break[stream[after - 1 : end - 1].long()]
        first, last = torch.searchsorted(document_starts, torch.tensor([start, end])).tolist()
        starts_here[document_starts[first:last] - start] = True
        found.append(starts_here.nonzero().squeeze(1) + start)
    return torch.cat(found)


class TrainingSequences:
    """Training batches of sequences, each beginning at one of the stream's *starts*.

    The starts are the document boundaries, or with ``line_breaks`` (token ids that end a line,
    :func:`line_break_ids`) also every line inside a document. Either way a sample is
    ``[bos] + stream[start : start + context_length]`` over the training documents only.

    The token stream is stored once, flat; a batch is gathered by index arithmetic. Which
    starts begin the sequences of a step depends only on (seed, step, batch_size): sample
    ``k = step * batch_size + b`` of the run begins at start ``order(epoch)[k % S]`` with
    ``epoch = k // S``, where ``order`` is a seeded permutation of the S starts. So every start
    begins exactly one sequence per epoch, a resumed run sees the same data, and runs that
    differ only in their positional encoding train on identical batches.
    """

    def __init__(
        self,
        documents: Documents,
        context_length: int,
        seed: int,
        special: SpecialIds,
        line_breaks: Collection[int] | None = None,
    ) -> None:
        """``documents``: token ids of each training document (see :func:`encode_documents`),
        or the stream :func:`encode_stream` made of them (kept as it is, in its own dtype)."""
        _require_positive("context_length", context_length)
        self.context_length = context_length
        self.seed = seed
        self.special = special
        self.stream, self.document_starts = _document_stream(documents, special.eos)
        self.starts = (
            self.document_starts
            if line_breaks is None
            else _line_starts(self.stream, self.document_starts, line_breaks)
        )

    @property
    def num_documents(self) -> int:
        return len(self.document_starts)

    @property
    def num_starts(self) -> int:
        """Distinct sequences the sampler draws from (``num_documents`` without line starts)."""
        return len(self.starts)

    @property
    def num_tokens(self) -> int:
        """Tokens in the stream, one ``<|eos|>`` per document included."""
        return len(self.stream)

    def start_order(self, epoch: int) -> torch.Tensor:
        """The permutation [S] of start indices used in ``epoch``."""
        generator = torch.Generator().manual_seed(self.seed * _EPOCH_SEED_STRIDE + epoch)
        return torch.randperm(self.num_starts, generator=generator)

    def start_indices(self, step: int, batch_size: int) -> torch.Tensor:
        """Indices [B] into ``starts`` of the sequences of ``step`` (document indices when
        sequences start at documents only)."""
        if step < 0:
            raise DataError(f"step must be non-negative, got {step}")
        _require_positive("batch_size", batch_size)
        sample = step * batch_size + torch.arange(batch_size)
        epochs = sample // self.num_starts
        starts = torch.empty(batch_size, dtype=torch.long)
        # A batch spans at most a few epochs (one unless batch_size approaches S).
        for epoch in epochs.unique().tolist():
            in_epoch = epochs == epoch
            starts[in_epoch] = self.start_order(epoch)[sample[in_epoch] % self.num_starts]
        return starts

    def sequences(self, start_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, both [B, context_length] long, for sequences beginning at
        ``starts[start_indices]``.

        Where the stream runs out, inputs hold ``<|pad|>`` and targets :data:`IGNORE_INDEX`.
        """
        offsets = self.starts[start_indices].unsqueeze(1) + torch.arange(self.context_length)
        real = offsets < self.num_tokens
        following = self.stream[offsets.clamp(max=self.num_tokens - 1)].long()
        targets = following.masked_fill(~real, IGNORE_INDEX)
        bos = torch.full((len(start_indices), 1), self.special.bos, dtype=torch.long)
        shifted = following[:, :-1].masked_fill(~real[:, :-1], self.special.pad)
        return torch.cat([bos, shifted], dim=1), targets

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of training step ``step``: inputs [B, T] and targets [B, T], long."""
        return self.sequences(self.start_indices(step, batch_size))


def boundary_sequences(documents: Documents, length: int, special: SpecialIds) -> torch.Tensor:
    """One training-style input sequence starting at every document → [D, length] long.

    ``<|bos|>`` first, then the document and those after it (padding where the stream ends):
    the sequences whose position-by-position statistics the geometry analysis measures — always
    speech-aligned, whatever starts training uses.
    """
    everything = TrainingSequences(documents, length, seed=0, special=special)
    return everything.sequences(torch.arange(everything.num_documents))[0]


@dataclass(frozen=True)
class ValidationStream:
    """All validation documents as one stream ``doc + [eos] + doc + [eos] ...`` for scoring.

    ``characters`` is what the scored tokens stand for (see :func:`count_characters`), so
    bits-per-character = total NLL in nats / (ln 2 * characters).
    """

    tokens: torch.Tensor  # [L] long
    starts: torch.Tensor  # [D] offset of each document in ``tokens``
    characters: int
    special: SpecialIds

    def windows(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows scoring every token exactly once (:func:`scoring_windows`)."""
        return scoring_windows(self.tokens, self.starts, window, self.special)


def scoring_windows(
    tokens: torch.Tensor, starts: torch.Tensor, window: int, special: SpecialIds
) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows scoring every token of ``tokens`` [L] exactly once, each starting at a document
    boundary (``starts`` [D], the offset of each document).

    Returns inputs, targets [N, window]. Whole documents (each with its <|eos|>) are packed
    into a window while they fit, as training sequences are laid out; a document longer than
    a window continues in the next one. Inputs are ``[bos]`` + the targets shifted by one;
    unused room is padding (target :data:`IGNORE_INDEX`).

    Only where a document ends decides where a window does: so of a stream cut short inside
    its last document, every window but the last is a window of the whole stream.
    """
    _require_positive("window", window)
    ends = torch.cat([starts[1:], torch.tensor([len(tokens)])])
    chunks: list[tuple[int, int]] = []  # [start, end) of each window's targets
    chunk_start = 0
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        if end - chunk_start <= window:
            continue  # this document still fits in the current window
        if start > chunk_start:
            chunks.append((chunk_start, start))
            chunk_start = start
        while end - chunk_start > window:  # a document longer than a window
            chunks.append((chunk_start, chunk_start + window))
            chunk_start += window
    chunks.append((chunk_start, len(tokens)))
    targets = torch.full((len(chunks), window), IGNORE_INDEX, dtype=torch.long)
    for row, (start, end) in enumerate(chunks):
        targets[row, : end - start] = tokens[start:end]
    bos = torch.full((len(chunks), 1), special.bos, dtype=torch.long)
    shifted = targets[:, :-1].masked_fill(targets[:, :-1] == IGNORE_INDEX, special.pad)
    return torch.cat([bos, shifted], dim=1), targets


def first_windows(
    tokenizer: Tokenizer, pieces: Iterable[Piece], window: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``count`` windows (:func:`scoring_windows`) of the documents of ``pieces``,
    encoding no more of them than those windows need: [N, window] inputs and targets, N at most
    ``count``. ``count + 1`` windows' worth of tokens is enough: every window but the last of a
    stream cut there is a window of the whole one."""
    stream = encode_stream(tokenizer, pieces, enough=(count + 1) * window)
    inputs, targets = scoring_windows(stream.tokens, stream.starts, window, special_ids(tokenizer))
    return inputs[:count], targets[:count]


def validation_stream(tokenizer: Tokenizer, documents: Sequence[str]) -> ValidationStream:
    """Encode the validation documents into one stream and count the characters it stands for."""
    special = special_ids(tokenizer)
    tokens, starts = _document_stream(encode_documents(tokenizer, documents), special.eos)
    return ValidationStream(tokens, starts, count_characters(tokenizer, tokens), special)


def validation_windows(
    tokenizer: Tokenizer, documents: Sequence[str], window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shortcut for ``validation_stream(tokenizer, documents).windows(window)``."""
    return validation_stream(tokenizer, documents).windows(window)


def _padded_matrix(
    sequences: torch.Tensor | np.ndarray | Iterable[Sequence[int]], n_positions: int
) -> torch.Tensor:
    """Sequences as a [N, n_positions] long matrix, cut or padded with -1."""
    if isinstance(sequences, torch.Tensor | np.ndarray):
        matrix = torch.as_tensor(sequences, dtype=torch.long)
        if matrix.dim() != 2:
            raise DataError(f"sequences must be 2-D [N, length], got shape {tuple(matrix.shape)}")
        matrix = matrix[:, :n_positions]
    else:
        rows = [torch.as_tensor(row[:n_positions], dtype=torch.long) for row in sequences]
        if not rows:
            return torch.empty(0, n_positions, dtype=torch.long)
        matrix = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-1)
    return torch.nn.functional.pad(matrix, (0, n_positions - matrix.shape[1]), value=-1)


def positional_token_counts(
    sequences: torch.Tensor | np.ndarray | Iterable[Sequence[int]],
    n_positions: int,
    vocab_size: int,
    pad_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each token id occurs at each position: counts [n, V] and totals N_i [n], int64.

    ``sequences`` start at a document boundary: either a 2-D integer tensor/array [N, L] whose
    negative entries (e.g. :data:`IGNORE_INDEX`) and ``pad_id`` entries are padding, or an
    iterable of 1-D sequences of any length. Positions past ``n_positions`` are ignored;
    ``totals[i]`` counts the sequences with a real token at position i, so the positional
    distribution is ``mu_i = counts[i] / totals[i]``.
    """
    _require_positive("n_positions", n_positions)
    _require_positive("vocab_size", vocab_size)
    matrix = _padded_matrix(sequences, n_positions)
    real = matrix >= 0
    if pad_id is not None:
        real &= matrix != pad_id
    tokens = matrix[real]
    if len(tokens) and tokens.max() >= vocab_size:
        raise DataError(f"sequences hold token id {int(tokens.max())} >= vocab_size={vocab_size}")
    positions = torch.arange(n_positions).expand_as(matrix)
    cells = positions[real] * vocab_size + tokens
    counts = torch.bincount(cells, minlength=n_positions * vocab_size).view(n_positions, vocab_size)
    return counts, counts.sum(dim=1)
