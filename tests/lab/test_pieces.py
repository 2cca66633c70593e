"""Text in pieces (``lab.pieces``) and the stream training encodes from them
(``lab.data.encode_stream``): pieces tokenize exactly as the whole text, however the text
arrives in blocks; the stream and the first validation windows are those of the whole documents;
encoding holds a batch of ids, not the file's; and BPE training takes a run of one character
in linear time (1 MB of "a" never finished)."""

from __future__ import annotations

import time
import tracemalloc

import pytest
import torch

import lab.data
from lab.corpus import load_corpus
from lab.data import (
    _document_stream,
    encode_documents,
    encode_stream,
    first_windows,
    validation_stream,
)
from lab.pieces import cut_pieces, document_pieces, pieces_of
from model.tokenizer import MAX_TRAINING_WORD, bounded_words, special_ids, train_tokenizer

# Every way a line may begin and end: indented lines, blank lines in runs, trailing spaces,
# punctuation before a line break, a long line without one, CRs, and non-ASCII text.
AWKWARD = (
    "  indented\n\n\n   more indented  \nend.\n\t tab\r\nx" + "y" * 200 + "\n"
    "ça va, naïve café — ¿sí?\n" + " " * 40 + "\n" + "!!!\n?\n" + "z " * 100 + "\n\nlast"
)


@pytest.fixture(scope="module")
def text() -> str:
    speeches = load_corpus().train[:300]
    return "\n".join(speeches[:150]) + AWKWARD + "\n".join(speeches[150:])


@pytest.fixture(scope="module")
def tokenizer(text: str):  # type: ignore[no-untyped-def]
    return train_tokenizer([text], vocab_size=600)


def blocks_of(text: str, size: int) -> list[str]:
    return [text[start : start + size] for start in range(0, len(text), size)]


@pytest.mark.parametrize("block", [777, 10**6])
def test_pieces_tokenize_as_the_whole_text(text: str, tokenizer, block: int) -> None:  # type: ignore[no-untyped-def]
    pieces = list(cut_pieces(blocks_of(text, block), size=300))
    assert "".join(pieces) == text
    assert all(1 <= len(piece) <= 300 for piece in pieces)
    assert len(pieces) > len(text) // 300  # cut short at line breaks, not only where it had to
    whole = tokenizer.encode(text).ids
    assert [id_ for piece in pieces for id_ in tokenizer.encode(piece).ids] == whole


def test_a_long_line_is_cut_where_it_is_and_an_empty_document_is_one_piece() -> None:
    assert list(cut_pieces(["a" * 1000], size=300)) == ["a" * 300] * 3 + ["a" * 100]
    assert list(pieces_of([""])) == [("", True)]
    assert list(document_pieces(["ab", "c"], size=1)) == [
        ("a", False),
        ("b", True),
        ("c", True),
    ]


def test_the_stream_and_first_windows_are_those_of_the_whole_documents(
    text: str, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Batches of 2,000 characters, pieces of at most 300: the same ids and document starts as
    encoding every document whole; the first windows those of the whole validation stream."""
    monkeypatch.setattr(lab.data, "ENCODE_BATCH_CHARS", 2000)
    documents = [*load_corpus().train[:40], text[:5000], "", text[5000:9000]]
    stream = encode_stream(tokenizer, document_pieces(documents, size=300))
    tokens, starts = _document_stream(encode_documents(tokenizer, documents), stream.tokens[-1])
    assert stream.tokens.dtype == torch.int16  # 600 ids: two bytes a token
    assert torch.equal(stream.tokens.long(), tokens) and torch.equal(stream.starts, starts)

    special = special_ids(tokenizer)
    assert int(stream.tokens[-1]) == special.eos
    whole = validation_stream(tokenizer, documents)
    for window, count in [(32, 1), (32, 7), (100, 3), (64, 50), (128, 10_000)]:
        inputs, targets = first_windows(tokenizer, document_pieces(documents, 300), window, count)
        all_inputs, all_targets = whole.windows(window)
        assert torch.equal(inputs, all_inputs[:count]), (window, count)
        assert torch.equal(targets, all_targets[:count]), (window, count)


def test_encoding_holds_a_batch_of_ids_not_the_texts(
    text: str, tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Python's own allocations while 2 MB of text, read in blocks, is encoded in batches of
    64 K characters stay under 2 MB above twice the stream (2 bytes a token: the batches'
    arrays, then joined); encoding it whole, as before, held every id in a Python list (8 to
    36 bytes a token)."""
    monkeypatch.setattr(lab.data, "ENCODE_BATCH_CHARS", 1 << 16)
    big = (text * (2_000_000 // len(text) + 1))[:2_000_000]

    blocks = (big[start : start + (1 << 16)] for start in range(0, len(big), 1 << 16))
    tracemalloc.start()
    try:
        stream = encode_stream(tokenizer, pieces_of(blocks))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    stream_bytes = stream.tokens.numel() * stream.tokens.element_size()
    assert stream.tokens.numel() > 500_000
    assert peak - 2 * stream_bytes < 2_000_000, (peak, stream_bytes)


@pytest.mark.parametrize("character", ["a", " ", "\n", "7", "."])
def test_bpe_training_on_a_run_of_one_character_is_quick(character: str) -> None:
    """A word of n characters cost the BPE trainer n² (20,000 letters: 0.26 s, 40,000: 1.1 s):
    200,000 of one character, which took ~30 s, train in well under 3 s, and the words the
    trainer saw join back into the text."""
    text = "x " + character * 200_000 + " y"
    assert "".join(bounded_words([text])) == text
    assert max(map(len, bounded_words([text]))) <= MAX_TRAINING_WORD + 2
    started = time.perf_counter()
    tokenizer = train_tokenizer([text], vocab_size=300)
    assert time.perf_counter() - started < 3.0
    assert len(tokenizer.encode(character * 1000).ids) < 1000 // 8  # it did learn the runs
