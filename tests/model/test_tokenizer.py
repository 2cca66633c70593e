"""Properties of model.tokenizer: exact round trips on any text, fixed special ids, streaming
decode that never emits a broken character, character counts for bits-per-character, and
atomic save/load."""

import random

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from lab.corpus import load_corpus
from model.tokenizer import (
    MAX_BYTES_BESIDES,
    MAX_BYTES_PER_TOKEN,
    SPECIAL_TOKENS,
    IncrementalDecoder,
    TokenizerError,
    check_tokenizer_size,
    count_characters,
    load_tokenizer,
    save_tokenizer,
    special_ids,
    token_bytes,
    train_tokenizer,
)

VOCAB_SIZE = 512

# Code point ranges a random text is drawn from: ASCII, Latin-1, Greek, CJK, emoji, combining
# marks, and characters outside the BMP (four UTF-8 bytes each).
CODE_POINT_RANGES = [
    (0x20, 0x7E),
    (0x09, 0x0A),
    (0xA0, 0xFF),
    (0x370, 0x3FF),
    (0x300, 0x36F),
    (0x4E00, 0x9FFF),
    (0x1F300, 0x1F64F),
    (0x10000, 0x1FFFF),
]


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def tokenizer(corpus):
    # A small vocabulary on a slice of the corpus keeps this fast; the properties do not depend
    # on the size.
    return train_tokenizer(corpus.train[:3000], vocab_size=VOCAB_SIZE)


def random_text(rng: random.Random, length: int) -> str:
    characters = []
    for _ in range(length):
        low, high = rng.choice(CODE_POINT_RANGES)
        characters.append(chr(rng.randint(low, high)))
    return "".join(characters)


def random_texts(seed: int, count: int = 50) -> list[str]:
    rng = random.Random(seed)
    return [random_text(rng, rng.randint(0, 60)) for _ in range(count)]


def test_specials_take_the_first_ids_and_vocab_has_every_byte(tokenizer):
    assert special_ids(tokenizer) == (0, 1, 2)
    assert [tokenizer.id_to_token(i) for i in range(3)] == list(SPECIAL_TOKENS)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    assert set(pre_tokenizers.ByteLevel.alphabet()) <= tokenizer.get_vocab().keys()


@pytest.mark.parametrize("seed", range(3))
def test_random_unicode_round_trips_exactly(tokenizer, seed):
    for text in random_texts(seed):
        assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_corpus_round_trips_exactly(tokenizer, corpus):
    documents = list(corpus.validation[:500])
    encodings = tokenizer.encode_batch(documents)
    assert [tokenizer.decode(encoding.ids) for encoding in encodings] == documents


def test_special_token_text_in_input_is_ordinary_text(tokenizer):
    text = "ROMEO:\nsay <|eos|> and <|bos|>"
    ids = tokenizer.encode(text).ids
    assert not set(special_ids(tokenizer)) & set(ids)
    assert tokenizer.decode(ids) == text


def test_token_bytes_concatenate_to_the_utf8_text(tokenizer):
    table = token_bytes(tokenizer)
    assert len(table) == VOCAB_SIZE
    assert all(table[i] == b"" for i in special_ids(tokenizer))
    assert all(table[i] for i in range(3, VOCAB_SIZE))
    for text in random_texts(seed=10):
        ids = tokenizer.encode(text).ids
        assert b"".join(table[i] for i in ids) == text.encode("utf-8")


@pytest.mark.parametrize("seed", range(3))
def test_incremental_decoder_streams_only_whole_characters(tokenizer, seed):
    for text in random_texts(seed + 100):
        decoder = IncrementalDecoder(tokenizer)
        pieces = [decoder.push(i) for i in tokenizer.encode(text).ids]
        pieces.append(decoder.flush())
        for piece in pieces:
            piece.encode("utf-8")  # raises on a lone surrogate
            assert "\ufffd" not in piece
        assert "".join(pieces) == text


def test_incremental_decoder_holds_back_a_split_character(tokenizer):
    table = token_bytes(tokenizer)
    # A 4-byte emoji is never merged into one token at this vocabulary: its bytes arrive
    # across several ids, and nothing may come out before the last one.
    ids = tokenizer.encode("🎉").ids
    assert len(ids) > 1 and b"".join(table[i] for i in ids) == "🎉".encode()
    decoder = IncrementalDecoder(tokenizer)
    assert [decoder.push(i) for i in ids] == [""] * (len(ids) - 1) + ["🎉"]


def test_incremental_decoder_replaces_invalid_bytes(tokenizer):
    table = token_bytes(tokenizer)
    lone_continuation = table.index(b"\x80")
    lead_byte = table.index(b"\xf0")
    decoder = IncrementalDecoder(tokenizer)
    assert decoder.push(lone_continuation) == "\ufffd"
    assert decoder.push(lead_byte) == ""
    assert decoder.flush() == "\ufffd"
    with pytest.raises(TokenizerError, match="token_id"):
        decoder.push(VOCAB_SIZE)


def test_count_characters_counts_eos_once_and_bos_pad_never(tokenizer):
    bos, eos, pad = special_ids(tokenizer)
    texts = random_texts(seed=20, count=20)
    ids = [bos]
    for text in texts:
        ids += [*tokenizer.encode(text).ids, eos]
    ids += [pad] * 5
    expected = sum(map(len, texts)) + len(texts)
    assert count_characters(tokenizer, ids) == expected
    assert count_characters(tokenizer, torch.tensor(ids)) == expected


def test_save_and_load_round_trip_atomically(tokenizer, tmp_path):
    path = tmp_path / "tokenizer.json"
    save_tokenizer(tokenizer, path)
    save_tokenizer(tokenizer, path)  # overwriting works too
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]  # no temp file left
    loaded = load_tokenizer(path)
    text = "MACBETH:\nIs this a dagger <|eos|> 🗡️ which I see before me"
    assert loaded.encode(text).ids == tokenizer.encode(text).ids
    assert special_ids(loaded) == special_ids(tokenizer)


def test_bad_inputs_raise_clear_errors(tmp_path):
    with pytest.raises(TokenizerError, match="vocab_size"):
        train_tokenizer(["abc"], vocab_size=100)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(TokenizerError, match=r"broken\.json"):
        load_tokenizer(broken)
    with pytest.raises(TokenizerError, match="special tokens"):
        special_ids(Tokenizer(models.BPE()))


def test_a_tokenizer_larger_than_its_vocabulary_allows_is_refused_unread(tokenizer, tmp_path):
    """check_tokenizer_size: tokenizer.json, or the tokenizer_config.json beside it, larger than
    1 KiB a token (+ 1 MiB) is refused by its size alone: the file is not even JSON here."""
    save_tokenizer(tokenizer, tmp_path / "tokenizer.json")
    vocab = tokenizer.get_vocab_size()
    check_tokenizer_size(tmp_path / "tokenizer.json", vocab)  # a real one: 56 bytes a token
    most = vocab * MAX_BYTES_PER_TOKEN + MAX_BYTES_BESIDES
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes(b"x" * (most + 1))
        with pytest.raises(TokenizerError, match=f"{name} is .* MB: more than a tokenizer"):
            check_tokenizer_size(tmp_path / "tokenizer.json", vocab)
        save_tokenizer(tokenizer, tmp_path / "tokenizer.json")
        (tmp_path / "tokenizer_config.json").write_text("{}")
