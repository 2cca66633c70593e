"""``ordinal eval``: eval.json's fields, bits per character from characters (not tokens), table
schemes reporting longer windows as unsupported, the loss-by-position plot, files among the
checkpoints skipped, eval.json written only with --save (and then byte-identical when nothing
changed), and --reuse trusting the weights' hash, not file times.

Tiny random checkpoints are scored on a few dozen validation speeches (``load_corpus`` is
monkeypatched), so the whole file takes a few seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

import lab.evaluate
from lab.corpus import Corpus, load_corpus
from lab.data import IGNORE_INDEX, validation_stream
from lab.evaluate import EVAL_FILE, running_windows, token_losses
from model.checkpoint import data_section, save_checkpoint
from model.files import OutputError
from model.positional import TABLE_SCHEMES
from model.tokenizer import count_characters, special_ids, train_tokenizer
from model.transformer import Transformer
from ordinal import eval_options
from tests.model.conftest import tiny_config, tree_digest

CONTEXT = tiny_config().context_length
UNBOUNDED_SCHEMES = ("rope", "alibi")
SUPPORTED_FIELDS = {
    "window",
    "supported",
    "tokens",
    "loss",
    "bpc",
    "position_windows",
    "loss_by_position",
}


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
    names = [str(folder / scheme) for scheme in UNBOUNDED_SCHEMES + TABLE_SCHEMES]
    args = eval_args(*names, "--plot", str(folder / "plots" / "loss.png"), "--save")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lab.evaluate, "load_corpus", lambda: Corpus((), validation))
        yield lab.evaluate.run(args), folder


def eval_args(*argv: str) -> argparse.Namespace:
    """``ordinal eval``'s options, parsed."""
    parser = argparse.ArgumentParser()
    eval_options(parser)
    return parser.parse_args(argv)


@pytest.fixture
def one_checkpoint(
    tmp_path: Path, tokenizer: Tokenizer, validation: tuple[str, ...]
) -> Iterator[Path]:
    """A tiny rope checkpoint in a folder beside a README.md, scored on the small validation."""
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "rope", Transformer(tiny_config("rope")), tokenizer)
    (tmp_path / "README.md").write_text("not a checkpoint\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lab.evaluate, "load_corpus", lambda: Corpus((), validation))
        yield tmp_path / "rope"


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


@pytest.mark.parametrize("multiple", [1, 4])
def test_running_windows_run_on_past_the_last_speech_as_training_sequences_do(
    tokenizer: Tokenizer, validation: tuple[str, ...], multiple: int
) -> None:
    stream = validation_stream(tokenizer, validation)
    window = multiple * CONTEXT
    padded_inputs, targets = stream.windows(window)
    inputs, running = running_windows(stream, padded_inputs, targets)
    scored = targets != IGNORE_INDEX
    assert torch.equal(running[scored], targets[scored])  # the same tokens scored, in place
    starts, offset, full = set(stream.starts.tolist()), 0, 0
    for row in range(len(targets)):
        # each window begins at a speech, or where a speech longer than a window left off ...
        assert offset in starts or int(scored[row - 1].sum()) == window
        expected = stream.tokens[offset : offset + window]  # ... and runs on from there
        assert torch.equal(running[row, : len(expected)], expected)
        assert (running[row, len(expected) :] == IGNORE_INDEX).all()  # only past the stream's end
        assert inputs[row, 0] == stream.special.bos
        assert torch.equal(inputs[row, 1 : len(expected)], expected[:-1])
        full += len(expected) == window
        offset += int(scored[row].sum())
    assert offset == len(stream.tokens)
    # Two consecutive windows score more than a window's worth (the speech that did not fit
    # opens the next), so at most the last two start too near the end to run a full window.
    assert full >= len(targets) - 2
    assert (padded_inputs != inputs).any() and (~scored).any()  # there was padding to replace


def test_running_on_changes_no_scored_loss_and_fills_every_position(
    evaluated: tuple[list[dict[str, Any]], Path], tokenizer: Tokenizer, validation: tuple[str, ...]
) -> None:
    torch.manual_seed(3)
    causal = Transformer(tiny_config("alibi")).eval()
    stream = validation_stream(tokenizer, validation)
    padded_inputs, targets = stream.windows(2 * CONTEXT)
    inputs, running = running_windows(stream, padded_inputs, targets)
    scored = targets != IGNORE_INDEX
    padded = token_losses(causal, padded_inputs, targets)
    torch.testing.assert_close(token_losses(causal, inputs, running)[scored], padded[scored])
    # each report's loss by position: every position over the same windows, all the full ones
    reports, _ = evaluated
    for report in reports:
        for result in report["results"].values():
            if result["supported"]:
                _, targets = stream.windows(result["window"])
                starts = (targets != IGNORE_INDEX).sum(1).cumsum(0)[:-1]
                full = 1 + int((starts + result["window"] <= len(stream.tokens)).sum())
                assert result["position_windows"] == full


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


def test_every_drawn_line_of_the_plot_has_its_own_colour(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nineteen lines from twenty-three reports (a renamed rope's variants are not drawn): the
    skipped reports take no colour, so no two drawn lines share one (the shipped plot's count)."""

    def report(folder: str, scheme: str) -> dict[str, Any]:
        result = {"supported": True, "window": 4, "loss_by_position": [1.0] * 4}
        result["position_windows"] = 1
        return {
            "checkpoint": f"checkpoints/{folder}",
            "scheme": scheme,
            "context_length": 2,
            "results": {"1x": result},
        }

    plain = [report(f"s{i}", f"s{i}") for i in range(15)]
    variants = [report("rope", f"rope+v{i}") for i in range(4)]
    hidden = [report("prope", f"rope+v{i}") for i in range(4)]
    figures = []
    monkeypatch.setattr(lab.evaluate, "write_figure_atomic", lambda path, f, **_: figures.append(f))
    lab.evaluate.plot_loss_by_position(plain + hidden + variants, tmp_path / "loss.png")
    colours = [line.get_color() for line in figures[0].axes[0].get_lines()[:-1]]  # less the axvline
    assert len(colours) == 19 and len(set(map(str, colours))) == 19


def test_files_among_the_checkpoints_are_skipped_with_a_note(
    one_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = one_checkpoint.parent / "README.md"
    reports = lab.evaluate.run(eval_args(str(readme), str(one_checkpoint), "--multiples", "1"))
    assert [report["scheme"] for report in reports] == ["rope"]
    captured = capsys.readouterr()
    assert f"skipping {readme}" in captured.err
    assert "rope" in captured.out


def test_folders_without_a_config_are_skipped_with_a_note(
    one_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ordinal eval checkpoints/*`` passes over checkpoints/next, a folder of checkpoints."""
    staging = tmp_path / "next"
    staging.mkdir()
    reports = lab.evaluate.run(eval_args(str(staging), str(one_checkpoint), "--multiples", "1"))
    assert [report["scheme"] for report in reports] == ["rope"]
    assert f"skipping {staging}: a folder without config.json" in capsys.readouterr().err


def test_only_files_is_an_error(one_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="no checkpoint folders"):
        lab.evaluate.run(eval_args(str(one_checkpoint.parent / "README.md")))


def test_nothing_is_written_unless_asked(one_checkpoint: Path) -> None:
    before = sorted(path.name for path in one_checkpoint.iterdir())
    lab.evaluate.run(eval_args(str(one_checkpoint), "--multiples", "1"))
    assert sorted(path.name for path in one_checkpoint.iterdir()) == before
    assert not (one_checkpoint / EVAL_FILE).exists()


def test_saving_again_leaves_eval_json_byte_identical(one_checkpoint: Path) -> None:
    args = eval_args(str(one_checkpoint), "--multiples", "1", "2", "--save")
    lab.evaluate.run(args)
    saved = (one_checkpoint / EVAL_FILE).read_bytes()
    report = json.loads(saved)
    assert (
        report["weights_sha256"]
        == hashlib.sha256(
            data_section((one_checkpoint / "model.safetensors").read_bytes())
        ).hexdigest()
    )

    # float noise (another thread count or batch size) below the tolerance: the file stays
    noisy = json.loads(saved)
    noisy["results"]["1x"]["loss"] *= 1 + 1e-9
    (one_checkpoint / EVAL_FILE).write_text(json.dumps(noisy, indent=2))
    noisy_bytes = (one_checkpoint / EVAL_FILE).read_bytes()
    lab.evaluate.run(
        eval_args(str(one_checkpoint), "--multiples", "1", "2", "--save", "--batch-size", "3")
    )
    assert (one_checkpoint / EVAL_FILE).read_bytes() == noisy_bytes

    lab.evaluate.run(args)  # and an unchanged run rewrites nothing either
    assert (one_checkpoint / EVAL_FILE).read_bytes() == noisy_bytes


def test_reuse_checks_the_weights_hash_not_file_times(
    one_checkpoint: Path, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = eval_args(str(one_checkpoint), "--multiples", "1", "--save")
    first = lab.evaluate.run(args)[0]
    # a clone's file times: eval.json older than the weights. Same weights → reused.
    os.utime(one_checkpoint / EVAL_FILE, (0, 0))
    calls: list[Path] = []
    original = lab.evaluate.evaluate_checkpoint

    def counting(path: Path, *rest: Any) -> dict[str, Any]:
        calls.append(path)
        return original(path, *rest)

    monkeypatch.setattr(lab.evaluate, "evaluate_checkpoint", counting)
    reuse = eval_args(str(one_checkpoint), "--multiples", "1", "--reuse")
    assert lab.evaluate.run(reuse)[0]["results"] == first["results"]
    assert calls == []
    # a multiple it lacks → evaluated
    lab.evaluate.run(eval_args(str(one_checkpoint), "--multiples", "1", "2", "--reuse"))
    assert calls == [one_checkpoint]

    # other weights, eval.json newer than them → evaluated all the same (a save drops the old
    # eval.json; one copied back beside the new weights, as a sync tool might, is still stale)
    stale = (one_checkpoint / EVAL_FILE).read_bytes()
    torch.manual_seed(1)
    save_checkpoint(one_checkpoint, Transformer(tiny_config("rope")), tokenizer)
    assert not (one_checkpoint / EVAL_FILE).exists()
    (one_checkpoint / EVAL_FILE).write_bytes(stale)
    second = lab.evaluate.run(reuse)[0]
    assert calls == [one_checkpoint, one_checkpoint]
    assert second["weights_sha256"] != first["weights_sha256"]
    assert second["results"]["1x"]["loss"] != first["results"]["1x"]["loss"]


def test_a_reused_report_belongs_to_the_folder_it_was_read_from(
    one_checkpoint: Path, tmp_path: Path
) -> None:
    """A checkpoint evaluated in one folder and moved (checkpoints/next/x → checkpoints/x): its
    reused eval.json is labelled, and its table row filled, from where it now is."""
    lab.evaluate.run(eval_args(str(one_checkpoint), "--multiples", "1", "--save"))
    moved = tmp_path / "moved" / "rope"
    shutil.copytree(one_checkpoint, moved)
    (moved / "metrics.json").write_text(json.dumps({"tokens_seen": 9.8e6, "wall_seconds": 555}))
    report = lab.evaluate.saved_report(moved, [1])
    assert report is not None and report["checkpoint"] == str(moved)
    row = lab.evaluate.results_table([report]).splitlines()[-1]
    assert "| 9.8 M | 9.2 min |" in row


def test_reuse_rescores_an_eval_json_whose_curve_predates_the_running_windows(
    one_checkpoint: Path,
) -> None:
    lab.evaluate.run(eval_args(str(one_checkpoint), "--multiples", "1", "--save"))
    assert lab.evaluate.saved_report(one_checkpoint, [1]) is not None
    report = json.loads((one_checkpoint / EVAL_FILE).read_text())
    del report["results"]["1x"]["position_windows"]  # as eval.json files made before it
    (one_checkpoint / EVAL_FILE).write_text(json.dumps(report))
    assert lab.evaluate.saved_report(one_checkpoint, [1]) is None


def test_lengths_up_to_8x_and_rope_variants_on_the_same_weights(one_checkpoint: Path) -> None:
    """--lengths 1,2,4,8 scores four window lengths; --rope-variants adds one report per
    variant of each rope checkpoint, whose 1× loss differs from the plain one where the
    scaling changes the rotation at the trained length (linear) and not at all for dynamic
    (the trained base within the trained length)."""
    args = eval_args(
        str(one_checkpoint), "--lengths", "1,2,4,8", "--rope-variants", "linear2,dynamic4"
    )
    plain, linear, dynamic = lab.evaluate.run(args)
    assert [r["scheme"] for r in (plain, linear, dynamic)] == [
        "rope",
        "rope+linear2",
        "rope+dynamic4",
    ]
    assert list(plain["results"]) == ["1x", "2x", "4x", "8x"]
    assert plain["results"]["8x"]["window"] == 8 * CONTEXT
    assert linear["weights_sha256"] == plain["weights_sha256"]

    def losses(report: dict[str, Any], length: str) -> list[float]:
        return report["results"][length]["loss_by_position"]

    assert losses(linear, "1x") != losses(plain, "1x")  # positions ÷ 2 everywhere
    assert losses(dynamic, "1x") == losses(plain, "1x")  # within L: the trained base exactly
    assert losses(dynamic, "8x") != losses(plain, "8x")
    assert not (one_checkpoint / EVAL_FILE).exists()  # variants are never saved as the checkpoint's


@pytest.mark.parametrize(
    "bad", [["--lengths", "1,x"], ["--lengths", "0,2"], ["--rope-variants", "yarn"]]
)
def test_bad_lengths_or_variants_are_usage_errors(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        eval_args("some/checkpoint", *bad)


def test_the_table_names_renamed_checkpoints_and_states_a_bases_budget(tmp_path: Path) -> None:
    """prope is rope with a fraction, drope is none trained from rope: the table says which
    scheme each folder holds and, for drope, the base's budget before its own."""
    results = {"1x": {"window": 32, "bpc": 2.5, "supported": True}}
    reports = []
    for name, scheme in [("rope", "rope"), ("prope", "rope"), ("drope", "none")]:
        (tmp_path / name).mkdir()
        metrics: dict[str, Any] = {"tokens_seen": 400_000, "wall_seconds": 60.0}
        if name == "drope":
            metrics["init"] = {"scheme": "rope", "tokens_seen": 8_200_000, "wall_seconds": 600.0}
        (tmp_path / name / "metrics.json").write_text(json.dumps(metrics))
        report = {"checkpoint": str(tmp_path / name), "scheme": scheme, "parameters": 1000}
        reports.append({**report, "results": results})
    rows = lab.evaluate.results_table(reports).splitlines()[2:]
    assert rows == [
        "| rope | 1,000 | 0.4 M | 1.0 min | 2.500 |",
        "| prope (rope) | 1,000 | 0.4 M | 1.0 min | 2.500 |",
        "| drope (none) | 1,000 | 8.2 M + 0.4 M | 10.0 min + 1.0 min | 2.500 |",
    ]


def test_plot_and_table_never_replace_a_checkpoints_files_or_a_users(
    one_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--plot`` and ``--table`` follow the rule of every OUT (``model.files.check_output``):
    refused before anything is scored, the tree unchanged; --force only for a user's file."""
    readme = tmp_path / "README.md"
    weights = one_checkpoint / "model.safetensors"
    before = tree_digest(tmp_path)
    for argv in (
        ["--plot", str(weights)],  # the checkpoint's own weights
        ["--table", str(one_checkpoint / "results.md"), "--force"],  # inside a checkpoint
        ["--table", str(readme)],  # a user's file that is no results table
        ["--plot", str(readme)],
        ["--plot", str(tmp_path)],  # the folder holding the checkpoint
    ):
        with pytest.raises(OutputError):
            lab.evaluate.run(eval_args(str(one_checkpoint), "--multiples", "1", *argv))
        assert tree_digest(tmp_path) == before, argv
    assert capsys.readouterr().out == ""  # nothing was scored

    args = ["--multiples", "1", "--table", str(readme), "--plot", str(tmp_path / "loss.png")]
    lab.evaluate.run(eval_args(str(one_checkpoint), *args, "--force"))
    assert readme.read_text().startswith(lab.evaluate.TABLE_START)
    lab.evaluate.run(eval_args(str(one_checkpoint), *args))  # earlier outputs: no --force
