"""``ordinal eval``: eval.json's fields, bits per character from characters (not tokens), table
schemes reporting longer windows as unsupported, and the loss-by-position plot.

Tiny random checkpoints are scored on a few dozen validation speeches (``load_corpus`` is
monkeypatched), so the whole file takes a few seconds.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

import model.evaluate
from model.checkpoint import save_checkpoint
from model.corpus import Corpus, load_corpus
from model.evaluate import EVAL_FILE, add_arguments
from model.tokenizer import count_characters, special_ids, train_tokenizer
from model.transformer import Transformer
from tests.model.conftest import tiny_config

CONTEXT = tiny_config().context_length
TABLE_SCHEMES = ("learned", "mds", "lowrank")
UNBOUNDED_SCHEMES = ("rope", "alibi")
SUPPORTED_FIELDS = {"window", "supported", "tokens", "loss", "bpc", "loss_by_position"}


@pytest.fixture(scope="module")
def validation() -> tuple[str, ...]:
    return load_corpus().validation[:40]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_tokenizer(load_corpus().train[:300], vocab_size=300)


@pytest.fixture(scope="module")
def evaluated(
    tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer, validation: tuple[str, ...]
) -> Iterator[tuple[list[dict[str, Any]], Path]]:
    """``ordinal eval`` of tiny checkpoints (tables as long as the context) with --plot."""
    folder = tmp_path_factory.mktemp("eval")
    for seed, scheme in enumerate(UNBOUNDED_SCHEMES + TABLE_SCHEMES):
        torch.manual_seed(seed)
        config = tiny_config(scheme, max_positions=CONTEXT)
        save_checkpoint(folder / scheme, Transformer(config), tokenizer)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    names = [str(folder / scheme) for scheme in UNBOUNDED_SCHEMES + TABLE_SCHEMES]
    args = parser.parse_args([*names, "--plot", str(folder / "plots" / "loss.png")])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model.evaluate, "load_corpus", lambda: Corpus((), validation))
        yield model.evaluate.run(args), folder


def test_eval_json_carries_every_field(
    evaluated: tuple[list[dict[str, Any]], Path],
) -> None:
    reports, folder = evaluated
    assert [report["scheme"] for report in reports] == [*UNBOUNDED_SCHEMES, *TABLE_SCHEMES]
    for report in reports:
        on_disk = json.loads((folder / report["scheme"] / EVAL_FILE).read_text())
        assert on_disk == json.loads(json.dumps(report))
        assert on_disk["context_length"] == CONTEXT
        assert set(on_disk["results"]) == {"1x", "2x", "4x"}
        for multiple, result in on_disk["results"].items():
            window = int(multiple.removesuffix("x")) * CONTEXT
            assert result["window"] == window
            if result["supported"]:
                assert set(result) == SUPPORTED_FIELDS
                assert len(result["loss_by_position"]) == window
                assert all(math.isfinite(value) for value in result["loss_by_position"])
            else:
                assert set(result) == {"window", "supported", "reason"}
        one = on_disk["results"]["1x"]
        assert (on_disk["loss"], on_disk["bpc"]) == (one["loss"], one["bpc"])


def test_bits_per_character_divide_by_characters_not_tokens(
    evaluated: tuple[list[dict[str, Any]], Path],
    tokenizer: Tokenizer,
    validation: tuple[str, ...],
) -> None:
    reports, _ = evaluated
    eos = special_ids(tokenizer).eos
    stream = [id_ for text in validation for id_ in (*tokenizer.encode(text).ids, eos)]
    # byte-level BPE decodes exactly, and each <|eos|> stands for one separator character
    characters = sum(len(text) for text in validation) + len(validation)
    assert count_characters(tokenizer, stream) == characters
    for report in reports:
        assert report["validation_tokens"] == len(stream)
        assert report["validation_characters"] == characters != len(stream)
        for result in report["results"].values():
            if not result["supported"]:
                continue
            assert result["tokens"] == len(stream)  # every token scored exactly once
            expected = result["loss"] * result["tokens"] / (math.log(2) * characters)
            assert result["bpc"] == pytest.approx(expected, rel=1e-9)


def test_tables_as_long_as_the_context_report_longer_windows_unsupported(
    evaluated: tuple[list[dict[str, Any]], Path],
) -> None:
    reports, _ = evaluated
    for report in reports:
        results = report["results"]
        assert results["1x"]["supported"]
        if report["scheme"] in UNBOUNDED_SCHEMES:
            assert results["2x"]["supported"] and results["4x"]["supported"]
            continue
        for multiple in ("2x", "4x"):
            assert not results[multiple]["supported"]
            reason = results[multiple]["reason"]
            assert report["scheme"] in reason and f"{CONTEXT} positions" in reason


def test_plot_is_written(evaluated: tuple[list[dict[str, Any]], Path]) -> None:
    _, folder = evaluated
    assert (folder / "plots" / "loss.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
