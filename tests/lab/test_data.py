"""Properties of lab.data: training sequences start at a speech boundary (or, with line starts,
at a line of a speech) and are a pure function of (seed, step); the geometry's sequences stay
speech-aligned, and ``ordinal geometry`` measures those, not the sampler's; validation windows
score every token once; positional counts match a plain count."""

import random
import re

import numpy as np
import pytest
import torch

import lab.data
from lab.corpus import load_corpus
from lab.data import (
    IGNORE_INDEX,
    DataError,
    TokenStream,
    TrainingSequences,
    boundary_sequences,
    encode_documents,
    line_break_ids,
    positional_token_counts,
    validation_stream,
    validation_windows,
)
from lab.geometry.corpus import measure_corpus
from lab.geometry.report import load_corpus_geometry
from model.tokenizer import SpecialIds, save_tokenizer, special_ids, train_tokenizer

SPECIAL = SpecialIds(bos=0, eos=1, pad=2)
SPEAKER_PREFIX = re.compile(r"[A-Z][A-Z0-9 &'.,-]*:\n")


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return train_tokenizer(corpus.train[:3000], vocab_size=512)


@pytest.fixture(scope="module")
def train_ids(corpus, tokenizer):
    return encode_documents(tokenizer, corpus.train)


@pytest.fixture(scope="module")
def training(train_ids, tokenizer):
    return TrainingSequences(train_ids, context_length=48, seed=7, special=special_ids(tokenizer))


def random_documents(rng: random.Random, count: int) -> list[list[int]]:
    """Documents of ids 3..19 (clear of the specials), some of them empty."""
    return [[rng.randint(3, 19) for _ in range(rng.randint(0, 9))] for _ in range(count)]


def reference_pair(
    documents: list[list[int]], start: int, context_length: int
) -> tuple[list[int], list[int]]:
    """The spec spelled out: [bos] + doc_i + [eos] + doc_i+1 + [eos] ..., cut or padded to
    T + 1 tokens; inputs are all but the last, targets all but the first (padding ignored)."""
    sample = [SPECIAL.bos]
    for document in documents[start:]:
        sample += [*document, SPECIAL.eos]
    sample = sample[: context_length + 1]
    padding = context_length + 1 - len(sample)
    inputs = (sample + [SPECIAL.pad] * padding)[:-1]
    targets = sample[1:] + [IGNORE_INDEX] * padding
    return inputs, targets


def test_encode_documents_matches_single_encodes(tokenizer, corpus):
    documents = list(corpus.validation[:50])
    assert encode_documents(tokenizer, documents) == [tokenizer.encode(d).ids for d in documents]


@pytest.mark.parametrize("seed", range(5))
def test_sequences_follow_the_layout_and_pad_past_the_end(seed):
    rng = random.Random(seed)
    documents = random_documents(rng, rng.randint(1, 30))
    context_length = rng.randint(1, 40)
    training = TrainingSequences(documents, context_length, seed=seed, special=SPECIAL)
    starts = torch.arange(len(documents))
    inputs, targets = training.sequences(starts)
    assert inputs.shape == targets.shape == (len(documents), context_length)
    for start in range(len(documents)):
        expected_inputs, expected_targets = reference_pair(documents, start, context_length)
        assert inputs[start].tolist() == expected_inputs
        assert targets[start].tolist() == expected_targets


def test_every_document_starts_one_sequence_per_epoch():
    documents = random_documents(random.Random(0), 10)
    training = TrainingSequences(documents, context_length=4, seed=3, special=SPECIAL)
    # 3 per step for 10 steps: 30 samples = exactly 3 epochs, whose boundaries fall mid-batch.
    starts = torch.cat([training.start_indices(step, 3) for step in range(10)]).tolist()
    for epoch in range(3):
        assert sorted(starts[epoch * 10 : (epoch + 1) * 10]) == list(range(10))
    # A batch larger than the corpus spans several epochs at once; same samples, same starts.
    assert training.start_indices(0, 30).tolist() == starts


def test_batches_are_a_pure_function_of_seed_and_step(training, train_ids, tokenizer):
    again = TrainingSequences(train_ids, 48, seed=7, special=special_ids(tokenizer))
    other_seed = TrainingSequences(train_ids, 48, seed=8, special=special_ids(tokenizer))
    for step in random.Random(1).sample(range(100_000), 10):
        inputs, targets = training.batch(step, 16)
        inputs_again, targets_again = again.batch(step, 16)
        assert torch.equal(inputs, inputs_again) and torch.equal(targets, targets_again)
        assert not torch.equal(inputs, training.batch(step + 1, 16)[0])
        assert not torch.equal(inputs, other_seed.batch(step, 16)[0])


def test_every_training_sequence_begins_with_a_speaker(training, tokenizer):
    bos = special_ids(tokenizer).bos
    for step in random.Random(2).sample(range(100_000), 20):
        inputs, targets = training.batch(step, 32)
        assert (inputs[:, 0] == bos).all()
        real = targets[:, :-1] != IGNORE_INDEX
        assert torch.equal(inputs[:, 1:][real], targets[:, :-1][real])
        for row in inputs.tolist():
            assert SPEAKER_PREFIX.match(tokenizer.decode(row[1:])), tokenizer.decode(row[1:])


@pytest.fixture(scope="module")
def line_training(train_ids, tokenizer):
    return TrainingSequences(
        train_ids, 48, seed=7, special=special_ids(tokenizer), line_breaks=line_break_ids(tokenizer)
    )


def test_line_starts_are_every_speech_and_every_line_of_one(line_training, training, tokenizer):
    breaks = line_break_ids(tokenizer)
    assert breaks and all("\n" in tokenizer.decode([token]) for token in breaks)
    assert "\n" not in tokenizer.decode([t for t in range(512) if t not in breaks])
    starts = set(line_training.starts.tolist())
    assert set(training.starts.tolist()) <= starts  # every speech still starts sequences
    stream = line_training.stream.tolist()
    expected = set(training.starts.tolist()) | {
        i + 1 for i, token in enumerate(stream[:-1]) if token in breaks
    }
    assert starts == expected
    assert line_training.num_starts > 3 * line_training.num_documents  # many more sequences
    assert line_training.num_documents == training.num_documents


def test_line_starts_found_a_slice_at_a_time_are_the_same(
    line_training, train_ids, tokenizer, monkeypatch
):
    """Line breaks are looked for 1,000 tokens at a time (16 M in a run): the same starts, in
    order, each once; and the same from the compact stream ``encode_stream`` makes."""
    monkeypatch.setattr(lab.data, "_SCAN_TOKENS", 1000)
    special = special_ids(tokenizer)
    sliced = TrainingSequences(train_ids, 48, 7, special, line_break_ids(tokenizer))
    assert len(sliced.stream) > 50 * 1000
    assert torch.equal(sliced.starts, line_training.starts)
    stream = TokenStream(line_training.stream.to(torch.int16), line_training.document_starts)
    compact = TrainingSequences(stream, 48, 7, special, line_break_ids(tokenizer))
    assert torch.equal(compact.starts, line_training.starts)
    assert torch.equal(compact.batch(5, 16)[0], line_training.batch(5, 16)[0])


def test_line_start_sequences_begin_a_line_of_a_training_speech(line_training, tokenizer, corpus):
    """Every sequence is <|bos|> + a line of a training speech and what follows it: text of the
    training plays only (the stream holds no other), from the start of one of their lines."""
    train_lines = {line for speech in corpus.train for line in speech.split("\n")}
    validation_only = {
        line for speech in corpus.validation for line in speech.split("\n") if len(line) > 40
    } - train_lines
    assert len(validation_only) > 1000
    bos = special_ids(tokenizer).bos
    for step in random.Random(3).sample(range(100_000), 10):
        inputs, targets = line_training.batch(step, 32)
        assert (inputs[:, 0] == bos).all()
        real = targets[:, :-1] != IGNORE_INDEX
        assert torch.equal(inputs[:, 1:][real], targets[:, :-1][real])
        for row in inputs.tolist():
            # <|eos|> ends a speech: a line break for this purpose
            text = tokenizer.decode(row[1:], skip_special_tokens=False).replace("<|eos|>", "\n")
            text = text.replace("<|pad|>", "")
            first_line = text.split("\n")[0]
            assert first_line in train_lines or "\n" not in text, text
            assert not any(line in validation_only for line in text.split("\n")[1:-1])


def test_line_starts_keep_every_start_once_per_epoch_and_a_pure_function_of_the_step(
    line_training, train_ids, tokenizer
):
    count = line_training.num_starts
    first_epoch = torch.cat(
        [line_training.start_indices(step, 1000) for step in range(count // 1000)]
    )
    assert len(set(first_epoch.tolist())) == len(first_epoch)  # no start twice within an epoch
    again = TrainingSequences(
        train_ids, 48, seed=7, special=special_ids(tokenizer), line_breaks=line_break_ids(tokenizer)
    )
    for step in (0, 17, 5_000):
        assert torch.equal(line_training.batch(step, 16)[0], again.batch(step, 16)[0])


def test_the_geometry_sequences_are_speech_aligned_whatever_training_uses(
    train_ids, tokenizer, line_training
):
    """boundary_sequences (what ordinal geometry and the mds table measure) is one sequence per
    speech, [bos] + the speech and those after it: the line sampler changes none of it."""
    special = special_ids(tokenizer)
    sequences = boundary_sequences(train_ids, 48, special)
    assert sequences.shape == (len(train_ids), 48)
    for index in random.Random(4).sample(range(len(train_ids)), 200):
        following = [
            t for document in train_ids[index : index + 60] for t in (*document, special.eos)
        ]
        assert sequences[index].tolist() == [special.bos, *following[:47]]
    speech_starts = line_training.document_starts
    assert torch.equal(
        sequences,
        line_training.sequences(torch.searchsorted(line_training.starts, speech_starts))[0],
    )


def test_ordinal_geometry_measures_the_speech_aligned_statistics_not_the_samplers(
    tokenizer, train_ids, tmp_path
):
    """``ordinal geometry`` on Shakespeare (load_corpus_geometry) measures the sequences of the
    spec, one per training speech: [bos] + the speech and those after it, padded at the end;
    so its positional statistics are those, whatever training samples. Line-start sequences
    (the new sampler's) give clearly different statistics: a geometry that followed the
    training sampler would fail here."""
    n = 24
    path = tmp_path / "tokenizer.json"
    save_tokenizer(tokenizer, path)
    geometry = load_corpus_geometry("shakespeare", n, tokenizer_path=path)

    special, vocab = special_ids(tokenizer), tokenizer.get_vocab_size()
    stream = [t for document in train_ids for t in (*document, special.eos)] + [special.pad] * n
    offsets = np.cumsum([0, *(len(document) + 1 for document in train_ids)])[:-1]
    spec = torch.tensor([[special.bos, *stream[offset : offset + n - 1]] for offset in offsets])
    assert torch.equal(geometry.sequences, spec)
    expected = measure_corpus("spec", spec, vocab, special.pad, seed=0)
    np.testing.assert_allclose(geometry.hellinger, expected.hellinger, rtol=0, atol=1e-12)

    lines = TrainingSequences(train_ids, n, 0, special, line_break_ids(tokenizer))
    from_lines = lines.sequences(torch.arange(lines.num_starts))[0]
    line_geometry = measure_corpus("lines", from_lines, vocab, special.pad, seed=0)
    assert np.abs(line_geometry.hellinger - geometry.hellinger).max() > 0.1


@pytest.mark.parametrize("window", [1, 7, 64, 10_000])
def test_validation_windows_score_every_token_exactly_once(tokenizer, corpus, window):
    documents = corpus.validation[:300]
    stream = validation_stream(tokenizer, documents)
    inputs, targets = stream.windows(window)
    scored = targets[targets != IGNORE_INDEX]
    assert torch.equal(scored, stream.tokens)
    assert len(stream.tokens) == sum(len(d) + 1 for d in encode_documents(tokenizer, documents))
    assert inputs.shape == targets.shape and inputs.shape[1] == window
    assert (inputs[:, 0] == stream.special.bos).all()
    # Windows start at a document boundary, unless they continue a document longer than a window.
    window_starts = torch.cumsum((targets != IGNORE_INDEX).sum(1), 0) - (
        targets != IGNORE_INDEX
    ).sum(1)
    boundaries = set(stream.starts.tolist())
    for start in window_starts.tolist():
        previous_boundary = max(b for b in boundaries if b <= start)
        assert start in boundaries or start - previous_boundary >= window
    real = targets[:, :-1] != IGNORE_INDEX
    assert torch.equal(inputs[:, 1:][real], targets[:, :-1][real])
    assert (inputs[:, 1:][~real] == stream.special.pad).all()
    assert stream.characters == sum(map(len, documents)) + len(documents)
    shortcut_inputs, shortcut_targets = validation_windows(tokenizer, documents, window)
    assert torch.equal(shortcut_inputs, inputs) and torch.equal(shortcut_targets, targets)


def naive_counts(sequences, n_positions, vocab_size):
    counts = np.zeros((n_positions, vocab_size), dtype=np.int64)
    for sequence in sequences:
        for position, token in enumerate(sequence[:n_positions]):
            counts[position, token] += 1
    return counts


@pytest.mark.parametrize("seed", range(5))
def test_positional_counts_match_a_plain_count(seed):
    rng = random.Random(seed)
    vocab_size, n_positions = rng.randint(3, 30), rng.randint(1, 20)
    sequences = [[rng.randrange(vocab_size) for _ in range(rng.randint(0, 25))] for _ in range(40)]
    counts, totals = positional_token_counts(sequences, n_positions, vocab_size)
    expected = naive_counts(sequences, n_positions, vocab_size)
    assert np.array_equal(counts.numpy(), expected)
    assert totals.tolist() == [sum(len(s) > i for s in sequences) for i in range(n_positions)]
    # The same sequences as one padded matrix, padding marked both ways, count the same.
    width = max(map(len, sequences))
    matrix = torch.full((len(sequences), width), IGNORE_INDEX)
    for row, sequence in enumerate(sequences):
        matrix[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
    assert torch.equal(positional_token_counts(matrix, n_positions, vocab_size)[0], counts)
    padded_with_id = matrix.masked_fill(matrix == IGNORE_INDEX, vocab_size + 5)
    as_pad_id = positional_token_counts(padded_with_id, n_positions, vocab_size, vocab_size + 5)
    assert torch.equal(as_pad_id[0], counts)


def test_bad_arguments_raise_data_errors():
    documents = [[3, 4], [5]]
    with pytest.raises(DataError, match="context_length"):
        TrainingSequences(documents, context_length=0, seed=0, special=SPECIAL)
    with pytest.raises(DataError, match="documents"):
        TrainingSequences([], context_length=4, seed=0, special=SPECIAL)
    training = TrainingSequences(documents, context_length=4, seed=0, special=SPECIAL)
    with pytest.raises(DataError, match="step"):
        training.batch(-1, 2)
    with pytest.raises(DataError, match="batch_size"):
        training.batch(0, 0)
    with pytest.raises(DataError, match="vocab_size"):
        positional_token_counts([[1, 9]], n_positions=2, vocab_size=5)
    with pytest.raises(DataError, match="2-D"):
        positional_token_counts(torch.zeros(3, dtype=torch.long), n_positions=2, vocab_size=5)
