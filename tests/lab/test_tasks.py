"""The synthetic tasks: every generator is a pure function of (seed, length, count), makes the
lengths asked, and every answer it marks is what an independent reading of the tokens before it
gives; a short training run learns a task beyond chance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lab.tasks import (
    TASKS,
    TaskError,
    copying,
    counting,
    derive_seed,
    flipflop,
    indirect,
    longcount,
    needle,
    periodic,
    recall,
    task,
    variables,
)
from lab.tasks.base import TaskBatch
from lab.tasks.training import (
    SUITES,
    SuiteSettings,
    evaluation_batch,
    majority_accuracy,
    model_config,
    score,
    train_model,
)
from model.transformer import Transformer

SEEDS = (0, 1, 7, 12345)
LENGTHS = (17, 32, 33, 64, 128)


def flipflop_answers(tokens: list[int]) -> dict[int, int]:
    """Position → answer: the bit after each read is the bit after the latest write."""
    answers, written = {}, None
    for position in range(0, len(tokens) - 1, 2):
        instruction, bit = tokens[position], tokens[position + 1]
        if instruction == flipflop.WRITE:
            written = bit
        elif instruction == flipflop.READ:
            answers[position + 1] = written
    return answers


def recall_answers(tokens: list[int]) -> dict[int, int]:
    """Position → answer: after a query ``k?``, the value of k's latest assignment ``k=v``."""
    answers, current = {}, {}
    for position, token in enumerate(tokens):
        if token < recall.QUERY_0:
            current[token // recall.VALUES] = token % recall.VALUES
        elif token < recall.VALUE_0 and position + 1 < len(tokens):
            answers[position + 1] = recall.VALUE_0 + current[token - recall.QUERY_0]
    return answers


def copy_answers(tokens: list[int]) -> dict[int, int]:
    """Position → answer: after the marker come the non-blank tokens before it, in order."""
    marker = tokens.index(copying.MARKER)
    data = [token for token in tokens[:marker] if token != copying.BLANK]
    return {marker + 1 + i: token for i, token in enumerate(data)}


def counting_answers(tokens: list[int]) -> dict[int, int]:
    """Position → answer: after ``? s``, the count of s since the last marker."""
    answers, seen = {}, []
    for position, token in enumerate(tokens):
        if token == counting.MARKER:
            seen = []
        elif token == counting.QUERY and position + 2 < len(tokens):
            letter = tokens[position + 1]
            answers[position + 2] = counting.COUNT_0 + seen.count(letter)
        elif token < counting.LETTERS and tokens[position - 1] != counting.QUERY:
            seen.append(token)
    return answers


def longcount_answers(tokens: list[int]) -> dict[int, int]:
    """Position → answer: after ``? s``, the count of s since the last marker, blanks aside."""
    answers, seen = {}, []
    for position, token in enumerate(tokens):
        if token == counting.MARKER:
            seen = []
        elif token == counting.QUERY and position + 2 < len(tokens):
            answers[position + 2] = counting.COUNT_0 + seen.count(tokens[position + 1])
        elif token < counting.LETTERS and tokens[position - 1] != counting.QUERY:
            seen.append(token)
    return answers


def needle_answers(tokens: list[int]) -> dict[int, int]:
    """Position → answer: after ``k?``, the value of the needle ``k=v`` before it."""
    answers, needles = {}, {}
    for position, token in enumerate(tokens):
        if needle.NEEDLE_0 <= token < needle.QUERY_0:
            key, value = divmod(token - needle.NEEDLE_0, needle.VALUES)
            needles[key] = value
        elif needle.QUERY_0 <= token < needle.VALUE_0 and position + 1 < len(tokens):
            answers[position + 1] = needle.VALUE_0 + needles[token - needle.QUERY_0]
    return answers


def variables_answers(tokens: list[int]) -> dict[int, int]:
    """Position → answer: after ``x?``, x's value, following its copies back."""
    answers: dict[int, int] = {}
    source: dict[int, int | str] = {}  # variable → another variable, or "=v" for a value
    for position, token in enumerate(tokens):
        if variables.ASSIGN_0 <= token < variables.COPY_0:
            name, value = divmod(token - variables.ASSIGN_0, variables.VALUES)
            source[name] = f"={value}"
        elif variables.COPY_0 <= token < variables.QUERY_0:
            name, copied = divmod(token - variables.COPY_0, variables.VARIABLES)
            source[name] = copied
        elif variables.QUERY_0 <= token < variables.VALUE_0 and position + 1 < len(tokens):
            found = source[token - variables.QUERY_0]
            while not isinstance(found, str):
                found = source[found]
            answers[position + 1] = variables.VALUE_0 + int(found[1:])
    return answers


def indirect_answers(tokens: list[int]) -> dict[int, int]:
    """Position → answer: after ``? s o``, the item o places from s among the items."""
    items = tokens[: tokens.index(indirect.MARKER)]
    answers = {}
    for position, token in enumerate(tokens):
        if token == indirect.MARKER and position + 3 < len(tokens):
            source, offset = tokens[position + 1], tokens[position + 2] - indirect.OFFSET_0
            answers[position + 3] = items[items.index(source) + indirect.OFFSETS[offset]]
    return answers


SOLVERS = {
    "flipflop": flipflop_answers,
    "recall": recall_answers,
    "copy": copy_answers,
    "counting": counting_answers,
    "longcount": longcount_answers,
    "periodic": recall_answers,  # the same format: its answer is the latest assignment too
    "needle": needle_answers,
    "variables": variables_answers,
    "indirect": indirect_answers,
}


def test_every_task_has_an_independent_solver_here() -> None:
    assert set(SOLVERS) == set(TASKS)


def batches(name: str) -> list[tuple[int, int, TaskBatch]]:
    return [
        (seed, length, TASKS[name].generate(seed, length, 6))
        for seed in SEEDS
        for length in LENGTHS
        if length <= TASKS[name].max_length
    ]


@pytest.mark.parametrize("name", TASKS)
def test_a_generator_is_a_pure_function_of_seed_length_and_count(name: str) -> None:
    for seed, length, batch in batches(name):
        again = TASKS[name].generate(seed, length, 6)
        assert torch.equal(batch.tokens, again.tokens) and torch.equal(batch.answers, again.answers)
        assert batch.tokens.shape == batch.answers.shape == (6, length)
        assert batch.tokens.dtype == torch.long and batch.answers.dtype == torch.bool
        assert int(batch.tokens.min()) >= 0 and int(batch.tokens.max()) < TASKS[name].vocab_size
        other = TASKS[name].generate(seed + 1, length, 6)
        assert not torch.equal(batch.tokens, other.tokens)


@pytest.mark.parametrize("name", TASKS)
def test_every_answer_is_computable_from_the_tokens_before_it(name: str) -> None:
    for _, _, batch in batches(name):
        for tokens, marked in zip(batch.tokens.tolist(), batch.answers, strict=True):
            expected = SOLVERS[name](tokens)
            assert set(marked.nonzero().flatten().tolist()) == set(expected)
            assert all(tokens[position] == answer for position, answer in expected.items())


def positional_frequencies(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, n] token ids → [n, vocab] share of each token at each position."""
    counts = torch.nn.functional.one_hot(tokens, vocab_size).sum(dim=0)
    return counts / len(tokens)


@pytest.mark.parametrize("name", TASKS)
def test_a_task_is_stationary_exactly_when_it_says_so(name: str) -> None:
    """Stationary: the first n tokens (and answers) of 2n-token sequences are distributed as
    n-token sequences (total variation per position within sampling noise); the others differ
    at some position by far more."""
    n, count = 24, 4000
    short = TASKS[name].generate(1, n, count)
    prefix = TASKS[name].generate(2, 2 * n, count)
    vocab = TASKS[name].vocab_size
    apart = 0.5 * (
        positional_frequencies(short.tokens, vocab)
        - positional_frequencies(prefix.tokens[:, :n], vocab)
    ).abs().sum(dim=1)
    answers_apart = (short.answers.float().mean(0) - prefix.answers[:, :n].float().mean(0)).abs()
    largest = max(float(apart.max()), float(answers_apart.max()))
    if TASKS[name].stationary:
        assert largest < 0.1
    else:
        assert largest > 0.3


@pytest.mark.parametrize("name", TASKS)
def test_lengths_a_task_cannot_fill_are_refused(name: str) -> None:
    with pytest.raises(TaskError, match=name):
        TASKS[name].generate(0, TASKS[name].min_length - 1, 1)
    with pytest.raises(TaskError, match="count"):
        TASKS[name].generate(0, max(TASKS[name].min_length, 32), 0)


def test_recall_answers_are_the_latest_assignment_not_the_first() -> None:
    """Keys are reassigned, so an answer often differs from the key's first value: reading the
    first match instead of the latest one must fail."""
    tokens = recall.TASK.generate(3, 128, 8).tokens.tolist()
    differ = 0
    for row in tokens:
        first: dict[int, int] = {}
        for token in row[:32]:
            first.setdefault(token // recall.VALUES, token % recall.VALUES)
        answers = recall_answers(row)
        differ += sum(
            answer - recall.VALUE_0 != first[row[position - 1] - recall.QUERY_0]
            for position, answer in answers.items()
        )
    assert differ > 0.25 * 8 * 48


def test_flipflop_instructions_follow_the_papers_probabilities() -> None:
    kinds = flipflop.TASK.generate(5, 2000, 20).tokens[:, 2::2].flatten()
    for kind, probability in flipflop.PROBABILITIES.items():
        assert (kinds == kind).float().mean().item() == pytest.approx(probability, abs=0.01)


def test_an_unknown_task_names_the_valid_ones() -> None:
    with pytest.raises(TaskError, match="recall"):
        task("sorting")


def test_derived_seeds_are_reproducible_and_unrelated() -> None:
    assert derive_seed(0, 1, 2) == derive_seed(0, 1, 2)
    seeds = {derive_seed(0, seed, step) for seed in range(5) for step in range(100)}
    assert len(seeds) == 500
    assert derive_seed(1, 32) != derive_seed(0, 32)


def test_tables_have_rows_for_every_test_length_and_only_the_rows_read_in_training_change() -> None:
    settings = SUITES["quick"]
    config = model_config("learned", TASKS["flipflop"], settings)
    assert config.max_positions == max(settings.test_lengths)
    assert config.context_length == settings.length
    torch.manual_seed(0)  # what train_model draws its initial weights from for seed 0
    before = Transformer(config).positional.table
    after = train_model("learned", TASKS["flipflop"], 0, settings).positional.table
    inputs = settings.length - 1  # a training sequence of L tokens is L−1 inputs
    assert torch.equal(before[inputs:], after[inputs:])
    assert (before[:inputs] != after[:inputs]).any(dim=1).all()


def test_mds_rows_within_l_are_the_task_geometry() -> None:
    settings = SUITES["quick"]
    length = settings.length
    torch.manual_seed(0)  # what train_model draws its initial weights from for seed 0
    placeholder = Transformer(model_config("mds", TASKS["copy"], settings)).positional.coordinates
    coordinates = train_model("mds", TASKS["copy"], 0, settings).positional.coordinates
    assert coordinates[: settings.length].abs().sum() > 0
    assert torch.isfinite(coordinates).all()
    # Rows 0..L−1 are replaced by the task's geometry; the rows past L keep the placeholder.
    assert (coordinates[:length] != placeholder[:length]).any(dim=1).all()
    assert torch.equal(coordinates[length:], placeholder[length:])
    # P_MDS is centred: its coordinates average to zero over the L positions.
    torch.testing.assert_close(
        coordinates[:length].mean(dim=0), torch.zeros(coordinates.shape[1]), atol=1e-5, rtol=0
    )


def test_a_short_training_run_learns_flipflop_beyond_chance() -> None:
    settings = SuiteSettings(
        length=24,
        model={**SUITES["quick"].model, "n_layers": 2},
        train=dataclasses.replace(SUITES["full"].train, steps=150, batch_size=16, warmup_steps=20),
    )
    batch = evaluation_batch(TASKS["flipflop"], 24, 256)
    model = train_model("alibi", TASKS["flipflop"], 0, settings)
    accuracy = sum(score(model, batch)) / int(batch.answers.sum())
    assert accuracy > majority_accuracy(batch) + 0.2


def marker_to_query_spans(batch: TaskBatch) -> list[int]:
    """Tokens from each marker to the next query, over every row of ``batch``."""
    spans = []
    for row in batch.tokens.tolist():
        markers = [i for i, token in enumerate(row) if token == counting.MARKER]
        queries = [i for i, token in enumerate(row) if token == counting.QUERY]
        spans += [query - marker for marker, query in zip(markers, queries, strict=True)]
    return spans


def test_longcount_segments_grow_with_the_length_while_its_counts_do_not() -> None:
    """From T = 24 on, the spans are T/2 − 3 tokens; the letters per segment, the counts and the
    number of answers are distributed alike at T and 4T."""
    short, long = (longcount.TASK.generate(4, length, 2000) for length in (32, 128))
    spans = [torch.tensor(marker_to_query_spans(batch)).float() for batch in (short, long)]
    for span, length in zip(spans, (32, 128), strict=True):  # the marker, T/2 − 4 region tokens
        assert (span == length // 2 - longcount.FRAME + 1).all()
    for batch in (short, long):
        assert (batch.answers.sum(dim=1) == longcount.SEGMENTS).all()
    counts = [batch.tokens[batch.answers] - counting.COUNT_0 for batch in (short, long)]
    assert all(int(c.min()) >= 0 and int(c.max()) <= longcount.MOST for c in counts)
    shares = [torch.bincount(c, minlength=longcount.MOST + 1) / len(c) for c in counts]
    assert (shares[0] - shares[1]).abs().max() < 0.03
    letters = [int((b.tokens < counting.LETTERS).sum()) / len(b.tokens) for b in (short, long)]
    # each segment's letters plus its asked letter s, two segments per row
    assert letters[1] == pytest.approx(letters[0], rel=0.05)
    assert 2 * 2 < letters[0] < 2 * (longcount.MOST + 1)


def test_periodic_key_is_assigned_at_its_period_and_half_the_queries_ask_it() -> None:
    batch = periodic.TASK.generate(6, 128, 500)
    assigned = batch.tokens[:, : 128 // 2]
    repeated = assigned // recall.VALUES == periodic.REPEATED
    for row in repeated:
        places = row.nonzero().flatten()
        assert int(places[0]) < periodic.PERIOD
        assert (places.diff() == periodic.PERIOD).all()
        assert len(places) >= (128 // 2) // periodic.PERIOD
    phases = {int(row.nonzero()[0]) for row in repeated}
    assert phases == set(range(periodic.PERIOD))  # the phase is random, not a fixed position
    asked = batch.tokens[batch.answers.roll(-1, dims=1)] - recall.QUERY_0
    assert (asked == periodic.REPEATED).float().mean().item() == pytest.approx(
        0.5 + 0.5 / 6, abs=0.03
    )


def test_periodic_answers_need_the_latest_assignment_not_one_a_period_earlier() -> None:
    """Each answer for the repeated key differs from its assignment one period before the
    latest one in about 7 of 8 cases, and the distractors per query grow with the length."""
    for length in (32, 128):
        batch = periodic.TASK.generate(8, length, 300)
        differ = total = 0
        for row, answers in zip(batch.tokens.tolist(), batch.answers, strict=True):
            places = [i for i in range(length // 2) if row[i] // recall.VALUES == periodic.REPEATED]
            if len(places) < 2:
                continue
            before = row[places[-2]] % recall.VALUES
            for position in answers.nonzero().flatten().tolist():
                if row[position - 1] - recall.QUERY_0 == periodic.REPEATED:
                    total += 1
                    differ += row[position] - recall.VALUE_0 != before
        assert total > 0 and differ / total == pytest.approx(7 / 8, abs=0.06)


def test_needle_keys_are_distinct_and_more_needles_fill_a_longer_haystack() -> None:
    for length, most in ((32, 3), (128, 15)):
        tokens = TASKS["needle"].generate(3, length, 50).tokens
        needles = (tokens >= needle.NEEDLE_0) & (tokens < needle.QUERY_0)
        assert (needles.sum(1) == most).all()  # (length − 4) // 8, at least 2, at most 16
        for row, found in zip(tokens, needles, strict=True):
            keys = (row[found] - needle.NEEDLE_0) // needle.VALUES
            assert len(set(keys.tolist())) == len(keys)


def test_each_variables_query_asks_a_copy_two_hops_from_its_value() -> None:
    batch = TASKS["variables"].generate(5, 64, 50)
    for row in batch.tokens.tolist():
        copies = {
            (token - variables.COPY_0) // variables.VARIABLES
            for token in row
            if variables.COPY_0 <= token < variables.QUERY_0
        }
        asked = [token - variables.QUERY_0 for token in row[-4::2]]
        assert all(name in copies for name in asked) and asked[0] != asked[1]
        assert len(copies) == variables.CHAINS * variables.HOPS


def test_indirect_items_are_distinct_and_every_offset_is_asked() -> None:
    batch = TASKS["indirect"].generate(9, 64, 200)
    body = batch.tokens[:, : 64 - 4 * indirect.QUERIES]
    assert all(len(set(row.tolist())) == len(row) for row in body)
    offsets = batch.tokens[:, 64 - 4 * indirect.QUERIES + 2 :: 4] - indirect.OFFSET_0
    assert set(offsets.flatten().tolist()) == set(range(len(indirect.OFFSETS)))
