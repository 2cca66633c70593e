"""Your own text (``--data``): the three forms read the same documents, validation is held out
by document (by position when there is only one), bad input is an error naming the file and
line, and ``ordinal train --data`` on a small text built here trains (tiny preset), records its
data, evaluates on the held-out documents, enters ``ordinal geometry`` and serves. The file is
read in blocks, never whole; a JSON line nested 100,000 deep is one error line, and a megabyte
of one letter trains in seconds (it never finished)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import lab.pieces
import lab.text_corpus
import ordinal
from lab.text_corpus import (
    VALIDATION_EVERY,
    TextCorpusError,
    load_text_corpus,
    open_text_corpus,
    read_documents,
)
from lab.train import METRICS_FILE
from model.checkpoint import load_checkpoint
from tests.server.conftest import running_server, test_settings

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "and",
    "saw",
    "two",
    "birds",
    "fly",
    "over",
    "green",
    "hills",
    "near",
    "old",
    "river",
]


def documents(count: int, seed: int = 0) -> list[str]:
    """``count`` short documents of a few lines each, made of WORDS (not Shakespeare)."""
    rng = random.Random(seed)
    return [
        "\n".join(" ".join(rng.choices(WORDS, k=8)) for _ in range(rng.randint(2, 5)))
        + f"\n(note {number})"
        for number in range(count)
    ]


def write_forms(folder: Path, texts: list[str]) -> dict[str, Path]:
    """The same documents as a folder of .txt files and as JSONL."""
    (folder / "txt").mkdir(parents=True)
    for number, text in enumerate(texts):
        (folder / "txt" / f"{number:03d}.txt").write_text(text)
    lines = [json.dumps({"text": text, "id": number}) for number, text in enumerate(texts)]
    (folder / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return {"folder": folder / "txt", "jsonl": folder / "docs.jsonl"}


def test_a_folder_and_jsonl_give_the_same_documents_and_split(tmp_path: Path) -> None:
    texts = documents(25)
    forms = write_forms(tmp_path, texts)
    folder, jsonl = (load_text_corpus(path) for path in forms.values())
    assert read_documents(forms["folder"]) == read_documents(forms["jsonl"]) == texts
    assert (folder.train, folder.validation) == (jsonl.train, jsonl.validation)
    # every 10th document validates; none of them trains
    assert folder.validation == (texts[VALIDATION_EVERY - 1], texts[2 * VALIDATION_EVERY - 1])
    assert len(folder.train) == 23 and not set(folder.train) & set(folder.validation)
    assert "every 10th" in folder.split


def test_a_few_documents_hold_out_the_last(tmp_path: Path) -> None:
    texts = documents(4)
    corpus = load_text_corpus(write_forms(tmp_path, texts)["jsonl"])
    assert corpus.validation == (texts[-1],) and corpus.train == tuple(texts[:-1])


def test_one_document_holds_out_its_last_tenth_at_a_line_break(tmp_path: Path) -> None:
    text = "\n".join(documents(30))
    (tmp_path / "book.txt").write_text(text)
    corpus = load_text_corpus(tmp_path / "book.txt")
    (train,), (validation,) = corpus.train, corpus.validation
    assert train + validation == text
    assert train.endswith("\n")  # cut where a line starts
    assert 0.05 < len(validation) / len(text) < 0.2
    assert "10%" in corpus.split and str(len(validation)) in corpus.split


REPO = Path(__file__).resolve().parents[2]


def test_one_document_read_in_small_blocks_splits_as_a_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of 97 characters, pieces of 50: the same split and the same text, each piece
    at most 50 characters; the training part never holds validation text."""
    text = "\n".join(documents(30))
    (tmp_path / "book.txt").write_text(text)
    whole = load_text_corpus(tmp_path / "book.txt")
    monkeypatch.setattr(lab.text_corpus, "BLOCK_CHARS", 97)
    monkeypatch.setattr(lab.pieces, "PIECE_CHARS", 50)
    source = open_text_corpus(tmp_path / "book.txt")
    assert source.split == whole.split
    assert source.documents_of("train") == whole.train
    assert source.documents_of("validation") == whole.validation
    assert source.characters == {
        "train": len(whole.train[0]),
        "validation": len(whole.validation[0]),
    }
    assert all(len(piece.text) <= 50 for piece in source.pieces("train"))


NESTED = '{"text": "fine"}\n' + "[" * 100_000 + "]" * 100_000 + "\n"


@pytest.mark.parametrize(
    ("name", "content", "complaint"),
    [
        ("empty.txt", "  \n", "holds no text"),
        ("bad.jsonl", '{"text": "fine"}\n{"body": "no text"}\n', 'line 2: no "text"'),
        ("broken.jsonl", '{"text": "fine"}\nnot json\n', "line 2: not JSON"),
        ("latin1.txt", b"caf\xe9", "line 1: not UTF-8"),
        ("latin1.jsonl", b'{"text": "a"}\n\n{"text": "caf\xe9"}\n', "line 3: not UTF-8"),
        ("nested.jsonl", NESTED, "line 2: not JSON [(]nested too deeply"),
        ("digits.jsonl", '{"text": "a", "n": ' + "9" * 5000 + "}\n", "line 1: not JSON"),
        ("surrogate.jsonl", '{"text": "ok"}\n{"text": "a\\ud800b"}\n', "line 2: .* surrogate"),
    ],
)
def test_bad_data_is_named(tmp_path: Path, name: str, content: str | bytes, complaint: str) -> None:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(TextCorpusError, match=complaint):
        load_text_corpus(path)


def test_a_jsonl_line_too_long_to_parse_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lab.text_corpus, "MAX_LINE_CHARS", 100)
    path = tmp_path / "long.jsonl"
    path.write_text('{"text": "short"}\n{"text": "' + "x" * 200 + '"}\n')
    with pytest.raises(TextCorpusError, match="line 2: longer than 100 characters"):
        open_text_corpus(path)


def test_a_json_line_nested_100000_deep_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was a RecursionError traceback."""
    data = tmp_path / "nested.jsonl"
    data.write_text(NESTED)
    out = ["train", "--scheme", "rope", "--preset", "tiny", "--out", str(tmp_path / "ck")]
    assert ordinal.main([*out, "--data", str(data)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error
    assert error == f"ordinal train: error: {data}, line 2: not JSON (nested too deeply)\n"


def test_a_megabyte_of_one_letter_trains_within_30_seconds(tmp_path: Path) -> None:
    """1 MB of "a" never finished (BPE training's cost grows with the square of a word's
    length): now it trains, in a process of its own so that a hang fails the test."""
    data = tmp_path / "a.txt"
    data.write_text("a" * 1_000_000)
    command = [sys.executable, str(REPO / "ordinal.py"), "train", "--scheme", "rope"]
    command += ["--preset", "tiny", "--threads", "1", "--data", str(data)]
    command += ["--out", str(tmp_path / "ck"), "--state-dir", str(tmp_path / "state")]
    started = time.monotonic()
    finished = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    took = time.monotonic() - started
    assert finished.returncode == 0, finished.stderr
    assert took <= 30, took
    assert "tokenizing: 100%" in finished.stderr  # the progress bar
    assert "distinct tokens" in finished.stderr  # the note: the text repeats itself
    metrics = json.loads((tmp_path / "ck" / METRICS_FILE).read_text())
    assert metrics["step"] == 6 and metrics["data"]["characters"]["validation"] == 100_000


def test_a_missing_path_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["train", "--scheme", "rope", "--preset", "tiny", "--out", str(tmp_path / "ck")]
    assert ordinal.main([*args, "--data", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt does not exist" in capsys.readouterr().err


def test_train_on_your_own_text_evaluates_and_serves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_forms(tmp_path / "data", documents(40))["jsonl"]
    checkpoints = tmp_path / "checkpoints"
    for scheme in ("rope", "learned"):
        flags = ["--scheme", scheme, "--preset", "tiny", "--data", str(data), "--threads", "1"]
        out = checkpoints / scheme
        state = str(tmp_path / "state")
        assert ordinal.main(["train", *flags, "--out", str(out), "--state-dir", state]) == 0
        assert "every 10th held out" in capsys.readouterr().err  # the split is stated

        metrics = json.loads((out / METRICS_FILE).read_text())
        assert metrics["data"]["path"] == str(data)
        assert metrics["data"]["documents"] == {"train": 36, "validation": 4}
        assert all(loss > 0 for _, loss in metrics["val_loss"])

    # Both runs trained the same tokenizer on the same text: the schemes compare fairly.
    rope, learned = (load_checkpoint(checkpoints / s, device="cpu") for s in ("rope", "learned"))
    assert rope.tokenizer.to_str() == learned.tokenizer.to_str()
    # its merges are this text's (trained on it, not on Shakespeare): its words are one token
    assert all(len(rope.tokenizer.encode(f" {word}").ids) == 1 for word in ("cat", "fly"))

    assert ordinal.main(["eval", str(checkpoints / "rope"), "--data", str(data), "--save"]) == 0
    report = json.loads((checkpoints / "rope" / "eval.json").read_text())
    assert report["data"] == str(data)
    held_out = sum(len(text) for text in load_text_corpus(data).validation) + 4  # + 4 × <|eos|>
    assert report["validation_characters"] == held_out

    geometry = ["geometry", "--corpus", str(data), "--checkpoints", str(checkpoints / "rope")]
    assert ordinal.main([*geometry, "--out", str(tmp_path / "geometry")]) == 0
    measured = json.loads((tmp_path / "geometry" / "report.json").read_text())["corpus"]
    assert measured["name"] == str(data)
    assert measured["n_sequences"] == 36  # one sequence per training document

    with (
        running_server(test_settings(checkpoints)) as running,
        httpx.Client(base_url=running.url, timeout=60) as client,
    ):
        body = {"model": "learned", "prompt": "the cat", "max_tokens": 4, "ignore_eos": True}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
