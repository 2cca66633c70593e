"""``ordinal train``: the shipped preset is what it uses by default, a short run learns, a resumed
run equals an uninterrupted one (AdamW; and the v2 preset's Muon recipe, QK-norm on, bit
for bit), no draw of the sampler (speech or line starts, any seed) reaches the validation plays,
the mds scheme gets the training corpus's speech-aligned geometry whatever the sampler, a bad
config is a one-line error, two processes under ``torchrun`` (gloo, DDP) follow one process's loss
curve with the same global batch, ``make checkpoints`` rebuilds checkpoints with its recipe
(on the tiny preset), DroPE (``--scheme none --init``) starts from the base's weights and records
it, and each scheme of the second round (fox, cope, fire, rope at fraction 0.75) trains.

Training runs on a slice of the training split (monkeypatched ``load_corpus``) so the whole file
takes seconds; the code under test is unchanged: it trains its tokenizer, encodes, samples and
saves exactly as it does on the full corpus.
"""

from __future__ import annotations

import argparse
import bisect
import copy
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import lab.train
import model.config
from lab.corpus import Corpus, load_corpus
from lab.data import IGNORE_INDEX, TrainingSequences, boundary_sequences, encode_documents
from lab.geometry.corpus import measure_corpus
from lab.geometry.metrics import pairwise_distances
from lab.train import METRICS_FILE, STATE_FILE, prepare_tokenizer, start_from_checkpoint
from model.checkpoint import WEIGHTS_FILE, check_weights, load_checkpoint
from model.tokenizer import load_tokenizer, special_ids
from model.transformer import Transformer
from ordinal import build_parser, main, train_options
from tests.model.conftest import tree_digest

REPO = Path(__file__).resolve().parents[2]
# The venv's own torchrun (torch's launcher), else one on PATH.
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which(
    "torchrun"
)

STEPS, BATCH, CONTEXT, VOCAB = 30, 8, 32, 300
TINY_MODEL = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--d-ff", "64"]


def small() -> Corpus:
    """Every speech of a few training plays and a few dozen validation speeches."""
    full = load_corpus()
    return Corpus(train=full.train[:3000], validation=full.validation[:40])


@pytest.fixture(scope="module")
def small_corpus() -> Iterator[Corpus]:
    small_one = small()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lab.train, "load_corpus", lambda: small_one)
        yield small_one


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory, small_corpus: Corpus) -> Path:
    """tokenizer.json trained once, the way the first training run would train it."""
    path = tmp_path_factory.mktemp("tokenizer") / "tok.json"
    prepare_tokenizer(path, VOCAB)
    return path


def train_args(folder: Path, tokenizer: Path, *extra: str, scheme: str = "rope") -> Any:
    """Parsed ``ordinal train`` options for a tiny model writing into ``folder``, on the v2
    recipe (float32, uncompiled: seconds per run; ``extra`` may name another preset)."""
    parser = argparse.ArgumentParser()
    train_options(parser)
    flags = [
        *("--preset", "v2"),
        *("--scheme", scheme, "--out", str(folder / "ck"), "--state-dir", str(folder / "state")),
        *("--tokenizer", str(tokenizer), *TINY_MODEL, "--vocab-size", str(VOCAB)),
        *("--context-length", str(CONTEXT), "--steps", str(STEPS), "--batch-size", str(BATCH)),
        *("--eval-every", "30", "--save-every", "15", "--eval-windows", "4", "--threads", "1"),
        *("--lr", "3e-3", "--warmup-steps", "3"),
    ]
    return parser.parse_args([*flags, *extra])


def losses(metrics: dict[str, Any]) -> list[float]:
    return [loss for _, loss in metrics["train_loss"]]


@pytest.fixture(scope="module")
def full_run(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_path: Path
) -> tuple[dict[str, Any], Path]:
    """An uninterrupted 30-step run: its returned metrics and its folder."""
    folder = tmp_path_factory.mktemp("full")
    return lab.train.run(train_args(folder, tokenizer_path)), folder


def test_short_run_lowers_the_loss_and_writes_metrics(
    full_run: tuple[dict[str, Any], Path], tokenizer_path: Path
) -> None:
    metrics, folder = full_run
    curve = losses(metrics)
    assert [step for step, _ in metrics["train_loss"]] == list(range(1, STEPS + 1))
    assert np.mean(curve[-5:]) < np.mean(curve[:5])

    on_disk = json.loads((folder / "ck" / METRICS_FILE).read_text())
    assert on_disk == json.loads(json.dumps(metrics))
    assert on_disk["tokens_seen"] == STEPS * BATCH * CONTEXT
    assert [step for step, _ in on_disk["val_loss"]] == [STEPS]
    assert all(math.isfinite(loss) for _, loss in on_disk["val_loss"])
    assert on_disk["wall_seconds"] > 0
    # the pace: wall time at each validation, reached before the run's end
    [(paced_step, wall_then)] = on_disk["wall_at_validation"]
    assert paced_step == STEPS and 0 < wall_then <= on_disk["wall_seconds"]
    assert on_disk["tokens_per_second"] == pytest.approx(
        on_disk["tokens_seen"] / on_disk["wall_seconds"]
    )

    loaded, tokenizer = load_checkpoint(folder / "ck", device="cpu")
    assert loaded.config.scheme == "rope"
    assert loaded.config.context_length == CONTEXT
    assert loaded.config.dtype == "bfloat16"  # the default storage dtype
    assert tokenizer.get_vocab() == load_tokenizer(tokenizer_path).get_vocab()


def test_resumed_run_equals_an_uninterrupted_one(
    tmp_path: Path,
    tokenizer_path: Path,
    full_run: tuple[dict[str, Any], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    requested_steps: list[int] = []

    class RecordingSequences(TrainingSequences):
        def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
            requested_steps.append(step)
            return super().batch(step, batch_size)

    monkeypatch.setattr(lab.train, "TrainingSequences", RecordingSequences)
    first = lab.train.run(train_args(tmp_path, tokenizer_path, "--stop-at", "15"))
    assert first["step"] == 15 and len(first["train_loss"]) == 15
    assert json.loads((tmp_path / "ck" / METRICS_FILE).read_text())["step"] == 15

    requested_steps.clear()
    resumed = lab.train.run(train_args(tmp_path, tokenizer_path, "--resume"))
    assert requested_steps == list(range(15, STEPS))  # continued, not restarted

    uninterrupted, folder = full_run
    assert [s for s, _ in resumed["train_loss"]] == [s for s, _ in uninterrupted["train_loss"]]
    np.testing.assert_allclose(losses(resumed), losses(uninterrupted), rtol=1e-4)
    assert resumed["tokens_seen"] == uninterrupted["tokens_seen"]

    expected = torch.load(folder / "state" / STATE_FILE, weights_only=False)
    actual = torch.load(tmp_path / "state" / STATE_FILE, weights_only=False)
    assert actual["step"] == expected["step"] == STEPS
    torch.testing.assert_close(actual["model"], expected["model"])


def test_the_shipped_preset_is_what_ordinal_train_uses_by_default(tmp_path: Path) -> None:
    out = ["train", "--scheme", "sinusoidal", "--out", str(tmp_path / "ck")]
    shipped = model.config.PRESETS["shipped"]
    model_config, train_config = lab.train.configs_from_args(build_parser().parse_args(out))
    assert model_config == shipped.model_config("sinusoidal")
    assert model_config.positional == {"scheme": "sinusoidal", "scale": 0.028}
    assert train_config == shipped.train

    tiny = model.config.PRESETS["tiny"]
    args = build_parser().parse_args([*out, "--preset", "tiny"])
    assert lab.train.configs_from_args(args) == (tiny.model_config("sinusoidal"), tiny.train)

    # preset < --config file < flags, the scheme's preset parameters included
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model": {"mlp": "relu2", "n_layers": 2, "positional": {"scale": 0.5}},
                "train": {"optimizer": "muon", "steps": 7},
            }
        )
    )
    flags = ["--preset", "tiny", "--config", str(config), "--n-layers", "3", "--steps", "9"]
    model_config, train_config = lab.train.configs_from_args(
        build_parser().parse_args([*out, *flags])
    )
    assert (model_config.mlp, model_config.n_layers, model_config.d_model) == ("relu2", 3, 32)
    assert model_config.positional == {"scheme": "sinusoidal", "scale": 0.5}
    assert (train_config.optimizer, train_config.steps) == ("muon", 9)
    assert train_config.batch_size == tiny.train.batch_size

    # A true/false setting is --NAME / --no-NAME; neither leaves the preset's.
    for given, expected in [
        ([], shipped.train.compile),
        (["--compile"], True),
        (["--no-compile"], False),
    ]:
        args = build_parser().parse_args([*out, *given])
        assert lab.train.configs_from_args(args)[1].compile is expected


def test_muon_run_resumed_equals_an_uninterrupted_one_and_never_sees_validation_text(
    tmp_path: Path,
    tokenizer_path: Path,
    small_corpus: Corpus,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The v2 preset's recipe at tiny sizes (Muon, ReLU², no dropout, sequences from any line: the
    shipped recipe in float32, uncompiled, without the average), with QK-norm on too: stopped at
    step 15 and resumed, it ends bit for bit where an uninterrupted run ends: weights, both
    optimisers' state and every logged loss."""
    seen: list[torch.Tensor] = []

    class RecordingSequences(TrainingSequences):
        def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
            inputs, targets = super().batch(step, batch_size)
            seen.append(inputs)
            return inputs, targets

    monkeypatch.setattr(lab.train, "TrainingSequences", RecordingSequences)
    (tmp_path / "config.json").write_text(json.dumps({"model": {"qk_norm": True}}))
    extra = ["--config", str(tmp_path / "config.json")]
    extra += ["--storage-dtype", "float32"]
    whole = lab.train.run(train_args(tmp_path / "whole", tokenizer_path, *extra))
    shipped = model.config.PRESETS["shipped"]
    assert whole["train"]["optimizer"] == shipped.train.optimizer == "muon"
    assert whole["train"]["sequence_starts"] == shipped.train.sequence_starts == "line"
    assert whole["model"]["mlp"] == shipped.model["mlp"] and whole["model"]["qk_norm"] is True
    assert whole["train"]["precision"] == "float32" and not whole["train"]["compile"]
    assert np.mean(losses(whole)[-5:]) < np.mean(losses(whole)[:5])

    lab.train.run(train_args(tmp_path / "parts", tokenizer_path, *extra, "--stop-at", "15"))
    resumed = lab.train.run(train_args(tmp_path / "parts", tokenizer_path, *extra, "--resume"))
    assert resumed["train_loss"] == whole["train_loss"]
    assert resumed["val_loss"][1:] == whole["val_loss"]  # the first: validated at --stop-at
    # the pace survives the resume: one wall reading per validation, in order
    assert [step for step, _ in resumed["wall_at_validation"]] == [15, STEPS]
    assert resumed["wall_at_validation"][0][1] < resumed["wall_at_validation"][1][1]
    expected = torch.load(tmp_path / "whole" / "state" / STATE_FILE, weights_only=False)
    actual = torch.load(tmp_path / "parts" / "state" / STATE_FILE, weights_only=False)
    assert expected["model"].keys() == actual["model"].keys()
    assert all(torch.equal(actual["model"][k], expected["model"][k]) for k in expected["model"])
    assert len(actual["optimizers"]) == 2  # AdamW and Muon, both restored
    for saved, reference in zip(actual["optimizers"], expected["optimizers"], strict=True):
        assert saved["state"].keys() == reference["state"].keys()
        for index, values in reference["state"].items():
            assert all(torch.equal(saved["state"][index][k], v) for k, v in values.items())
    muon_state = actual["optimizers"][1]["state"]
    assert muon_state and all("momentum_buffer" in value for value in muon_state.values())

    # The sampler draws from the training plays only, now from any line of a speech.
    tokenizer = load_tokenizer(tokenizer_path)
    train_lines = {line for speech in small_corpus.train for line in speech.split("\n")}
    validation_only = {
        line for speech in small_corpus.validation for line in speech.split("\n") if len(line) > 20
    } - train_lines
    assert validation_only
    texts = [
        tokenizer.decode(row[1:], skip_special_tokens=False).replace("<|eos|>", "\n")
        for batch in seen
        for row in batch.tolist()
    ]
    assert not any(line in text for text in texts for line in validation_only)
    speaker_first = sum(text.split("\n")[0].endswith(":") for text in texts)
    assert 0 < speaker_first < len(texts)  # some sequences start at a speech, others mid-speech


@pytest.mark.parametrize("starts", ["speech", "line"])
def test_no_draw_of_the_sampler_reaches_the_validation_plays(
    tmp_path: Path, tokenizer_path: Path, small_corpus: Corpus, starts: str
) -> None:
    """Every draw of the sampler ``ordinal train`` builds is one of its S sequences (one per
    start), whatever the seed and step. All S hold training text only: each line a sequence
    holds whole is a line of a training speech and its cut last line begins one (a sequence
    running off the end of the training stream is padded, never continued elsewhere)."""
    args = train_args(tmp_path, tokenizer_path, "--preset", "shipped")
    model_config, train_config = lab.train.configs_from_args(args)
    train_config = train_config.replace(sequence_starts=starts)
    sampler = lab.train.load_training_data(args.tokenizer, model_config, train_config).sequences
    every_input, every_target = sampler.sequences(torch.arange(sampler.num_starts))

    train_lines = sorted({line for speech in small_corpus.train for line in speech.split("\n")})
    validation_lines = {line for speech in small_corpus.validation for line in speech.split("\n")}
    assert len(validation_lines - set(train_lines)) > 100  # text the check below would catch
    tokenizer = load_tokenizer(tokenizer_path)
    rows = [[token for token in row if token != IGNORE_INDEX] for row in every_target.tolist()]
    for text in tokenizer.decode_batch(rows, skip_special_tokens=False):
        *whole, cut = text.replace("<|eos|>", "\n").split("\n")
        assert all(line in train_lines for line in whole), text
        cut = cut.rstrip("\ufffd")  # a character whose bytes the window cuts
        assert train_lines[bisect.bisect_left(train_lines, cut)].startswith(cut), text
    if starts == "line":
        assert sampler.num_starts > 3 * sampler.num_documents

    possible = {tuple(row) for row in every_input.tolist()}
    epoch = sampler.num_starts // train_config.batch_size
    for seed in range(20):
        reseeded = copy.copy(sampler)
        reseeded.seed = seed
        last = int((reseeded.start_order(0) == sampler.num_starts - 1).nonzero())
        steps = [0, epoch, 3 * epoch + 1, last // train_config.batch_size]  # the stream's end
        for step in steps:
            inputs, _ = reseeded.batch(step, train_config.batch_size)
            assert {tuple(row) for row in inputs.tolist()} <= possible


def test_make_checkpoints_rebuilds_with_the_preset_on_the_tiny_one(tmp_path: Path) -> None:
    """The Makefile's own recipe, run on the tiny preset into a tmp folder: the code path `make
    checkpoints` takes for the shipped ones (on the full corpus). One scheme and one evaluation
    length keep it under a minute: each `ordinal train` process spends ~10 s importing torch
    and parsing and encoding the corpus, whatever the model's size."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    checkpoints, runs = tmp_path / "checkpoints", tmp_path / "runs"
    command = [
        *("make", "--no-print-directory", "-o", ".venv/.installed", "checkpoints"),
        *("PRESET=tiny", "SCHEMES=rope", f"CHECKPOINT_DIR={checkpoints}", f"RUNS={runs}"),
        *("DROPE_FLAGS=--steps 3 --warmup-steps 1", "EVAL_FLAGS=--lengths 1"),
        *(f"ORDINAL={sys.executable} -m ordinal", f"PY={sys.executable}"),  # not .venv's
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    tiny = model.config.PRESETS["tiny"]
    loaded, _ = load_checkpoint(checkpoints / "rope", device="cpu")
    assert loaded.config.replace(dtype="float32") == tiny.model_config("rope")
    metrics = json.loads((checkpoints / "rope" / METRICS_FILE).read_text())
    assert metrics["train"] == dataclasses.asdict(tiny.train)
    assert (runs / "rope" / STATE_FILE).exists()
    for name in ("rope", "prope", "drope"):
        evaluated = json.loads((checkpoints / name / "eval.json").read_text())
        assert list(evaluated["results"]) == ["1x"]  # EVAL_FLAGS reached `ordinal eval`
    assert (runs / "tokenizer.json").exists()
    assert (checkpoints / "loss_by_position.png").exists()
    assert "rope" in (checkpoints / "results.md").read_text()
    # the two recipes that are not schemes: p-RoPE, and DroPE from the rope just built
    prope, _ = load_checkpoint(checkpoints / "prope", device="cpu")
    assert prope.config.positional == {"scheme": "rope", "fraction": 0.75}
    drope, _ = load_checkpoint(checkpoints / "drope", device="cpu")
    assert drope.config.scheme == "none"
    metrics = json.loads((checkpoints / "drope" / METRICS_FILE).read_text())
    assert metrics["init"]["checkpoint"] == str(checkpoints / "rope") and metrics["step"] == 3
    table = (checkpoints / "results.md").read_text()
    assert "| prope (rope) |" in table and "| drope (none) |" in table


@pytest.mark.parametrize("starts", ["speech", "line"])
def test_mds_table_is_the_training_corpus_geometry_and_is_not_trained(
    tmp_path: Path, tokenizer_path: Path, small_corpus: Corpus, starts: str
) -> None:
    # A table of n = 32 positions with rank 32 ≥ n - 1 keeps every MDS dimension, so distances
    # must reproduce the Hellinger matrix exactly (Hellinger distance is Euclidean). Line-start
    # training sequences change nothing here: the statistics are the speech-aligned ones.
    flags = ["--max-positions", str(CONTEXT), "--positional", '{"rank": 32}', "--steps", "3"]
    flags += ["--sequence-starts", starts]
    flags += ["--storage-dtype", "float32"]
    lab.train.run(train_args(tmp_path, tokenizer_path, *flags, scheme="mds"))
    trained, tokenizer = load_checkpoint(tmp_path / "ck", device="cpu")

    assert "positional.coordinates" in dict(trained.named_buffers())
    assert not any("positional" in name for name, _ in trained.named_parameters())

    special = special_ids(tokenizer)
    documents = encode_documents(tokenizer, small_corpus.train)
    sequences = boundary_sequences(documents, CONTEXT, special)
    geometry = measure_corpus("train", sequences, VOCAB, special.pad, seed=0)
    coordinates = trained.positional.coordinates.double().numpy()
    # float32 storage: distances agree to ~1e-6 of the largest (≤ √2) distance
    np.testing.assert_allclose(pairwise_distances(coordinates), geometry.hellinger, atol=1e-5)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('{"optimizer": {}}', "optimizer"),
        ('{"model": {"d_modle": 64}}', "d_modle"),
        ('{"train": {"stepz": 5}}', "stepz"),
        ('{"train": {"steps": "ten"}}', "train.steps"),
        ('{"train": {"eval_every": 0}}', "train.eval_every"),
        ('{"model": {"positional": {"scheme": "rope", "bass": 5}}}', "bass"),
        ('{"model": [64]}', "model"),
        ('{"model": {"positional": "rope"}}', "positional"),
        ("[1, 2]", "config.json"),
        ('{"train": {"steps": 5,}}', "config.json"),  # not JSON
    ],
)
def test_bad_config_file_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, named: str
) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    argv = ["train", "--scheme", "rope", "--out", str(tmp_path / "ck"), "--config", str(path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ordinal train: error:") and named in err
    assert "Traceback" not in err
    assert not (tmp_path / "ck").exists()


DROPE_STEPS = 4


@pytest.fixture(scope="module")
def drope_run(full_run: tuple[dict[str, Any], Path], tmp_path_factory: pytest.TempPathFactory):
    """DroPE on the tiny rope run: the same architecture with ``none``, from its weights, a few
    steps of recalibration (no --tokenizer: the base's own is used)."""
    _, rope_folder = full_run
    folder = tmp_path_factory.mktemp("drope")
    flags = [
        *("--scheme", "none", "--init", str(rope_folder / "ck"), "--out", str(folder / "ck")),
        *("--state-dir", str(folder / "state"), *TINY_MODEL, "--vocab-size", str(VOCAB)),
        *("--context-length", str(CONTEXT), "--steps", str(DROPE_STEPS)),
        *("--batch-size", str(BATCH), "--eval-every", "4", "--eval-windows", "4"),
        *("--threads", "1", "--warmup-steps", "1"),
    ]
    assert main(["train", *flags]) == 0
    return folder


def test_drope_loads_as_none_and_records_its_origin(
    full_run: tuple[dict[str, Any], Path], drope_run: Path
) -> None:
    rope_metrics, rope_folder = full_run
    model, tokenizer = load_checkpoint(drope_run / "ck", device="cpu")
    assert model.config.scheme == "none" and model.config.positional == {"scheme": "none"}
    rope, rope_tokenizer = load_checkpoint(rope_folder / "ck", device="cpu")
    assert tokenizer.get_vocab() == rope_tokenizer.get_vocab()
    origin = json.loads((drope_run / "ck" / METRICS_FILE).read_text())["init"]
    digest = check_weights(rope_folder / "ck" / WEIGHTS_FILE, rope.config)
    assert digest is not None
    assert origin == {
        "checkpoint": str(rope_folder / "ck"),
        "scheme": "rope",
        "positional": {"scheme": "rope"},
        "sha256": digest,
        "step": STEPS,
        "tokens_seen": rope_metrics["tokens_seen"],
        "wall_seconds": pytest.approx(rope_metrics["wall_seconds"]),
    }


def test_drope_starts_from_the_bases_weights_without_its_positions(
    full_run: tuple[dict[str, Any], Path], drope_run: Path
) -> None:
    """Before any step the model is the rope checkpoint, rotation removed: every weight equal,
    the logits not (rope mattered); its first training loss is the trained model's, far below
    the untrained start of the rope run."""
    rope_metrics, rope_folder = full_run
    rope = load_checkpoint(rope_folder / "ck", device="cpu").model
    start = Transformer(rope.config.replace(positional={"scheme": "none"}, dtype="float32"))
    start_from_checkpoint(start, rope_folder / "ck")
    for name, tensor in rope.state_dict().items():
        assert torch.equal(start.state_dict()[name], tensor), name
    tokens = torch.randint(VOCAB, (2, CONTEXT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.allclose(start.eval()(tokens), rope(tokens), atol=1e-3)
    drope_metrics = json.loads((drope_run / "ck" / METRICS_FILE).read_text())
    assert drope_metrics["tokens_seen"] == DROPE_STEPS * BATCH * CONTEXT
    assert losses(drope_metrics)[0] < losses(rope_metrics)[0] - 0.5


def test_init_with_another_architecture_is_a_one_line_error(
    full_run: tuple[dict[str, Any], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, rope_folder = full_run
    argv = ["train", "--scheme", "none", "--init", str(rope_folder / "ck")]
    argv += ["--out", str(tmp_path / "ck"), *TINY_MODEL, "--vocab-size", str(VOCAB)]
    assert main([*argv, "--context-length", str(CONTEXT), "--d-ff", "128"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ordinal train: error: --init") and "d_ff is 64" in err
    assert "Traceback" not in err and not (tmp_path / "ck").exists()
    assert main([*argv, "--init", str(tmp_path / "nowhere")]) == 2
    assert "is not a checkpoint" in capsys.readouterr().err


def short_run(out: Path, tokenizer: Path, state: Path, *extra: str) -> list[str]:
    """``ordinal train`` arguments: three steps of the tiny model into ``out``."""
    return [
        *("train", "--preset", "v2", "--scheme", "rope", "--out", str(out)),
        *("--state-dir", str(state), "--tokenizer", str(tokenizer), *TINY_MODEL),
        *("--vocab-size", str(VOCAB), "--context-length", str(CONTEXT), "--steps", "3"),
        *("--batch-size", str(BATCH), "--eval-every", "3", "--eval-windows", "4"),
        *("--threads", "1", *extra),
    ]


def test_train_refuses_occupied_or_dangerous_outs_before_it_starts(
    full_run: tuple[dict[str, Any], Path],
    tokenizer_path: Path,
    small_corpus: Corpus,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A user's folder or file, a folder of checkpoints, a path inside a checkpoint, the
    checkpoint ``--init`` reads, a folder holding the run's own state or its tokenizer: each a
    one-line refusal, exit 2, and the whole tree byte for byte as it was."""
    _, run_folder = full_run
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "plan.txt").write_text("a user's folder")
    (tmp_path / "draft.txt").write_text("a user's file")
    shutil.copytree(run_folder / "ck", tmp_path / "checkpoints" / "rope")
    (tmp_path / "runs").mkdir()
    tokenizer = Path(shutil.copy(tokenizer_path, tmp_path / "runs" / "tok.json"))
    state = tmp_path / "state"
    init = ["--init", str(tmp_path / "checkpoints" / "rope")]
    cases = [  # (OUT, extra flags, refused even with --force)
        (tmp_path / "notes", [], False),
        (tmp_path / "draft.txt", [], False),
        (tmp_path / "checkpoints", [], True),  # would delete every checkpoint in it
        (tmp_path / "checkpoints" / "rope" / "sub", [], True),
        (tmp_path / "checkpoints" / "rope", init, True),  # the weights it starts from
        (tmp_path / "run", ["--state-dir", str(tmp_path / "run" / "state")], True),
        (tmp_path / "runs", [], True),  # holds the tokenizer
        (tokenizer, [], True),
    ]
    before = tree_digest(tmp_path)
    for out, extra, always in cases:
        for force in [[], ["--force"]] if always else [[]]:
            assert main(short_run(out, tokenizer, state, *extra, *force)) == 2, (out, force)
            error = capsys.readouterr().err
            assert error.startswith("ordinal train: error: OUT "), error
            assert error.count("\n") == 1 and "Traceback" not in error, error
            assert tree_digest(tmp_path) == before, (out, force)


def test_train_force_replaces_a_folder_whole_and_a_checkpoint_without_its_scores(
    full_run: tuple[dict[str, Any], Path],
    tokenizer_path: Path,
    small_corpus: Corpus,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The new model was shown with the old one's eval.json and metrics.json; with --force a
    user's folder is replaced whole, nothing of it carried into the checkpoint."""
    _, run_folder = full_run
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "plan.txt").write_text("a user's folder")
    argv = short_run(tmp_path / "notes", tokenizer_path, tmp_path / "state-notes", "--force")
    assert main(argv) == 0
    assert not (tmp_path / "notes" / "plan.txt").exists()
    assert json.loads((tmp_path / "notes" / METRICS_FILE).read_text())["step"] == 3

    out = tmp_path / "ck"
    shutil.copytree(run_folder / "ck", out)  # a checkpoint of 30 steps, with metrics.json
    (out / "eval.json").write_text(json.dumps({"results": {"1x": {"bpc": 1.0}}}))
    capsys.readouterr()
    assert main(short_run(out, tokenizer_path, tmp_path / "state-ck")) == 0  # no --force needed
    assert f"{out} is replaced" in capsys.readouterr().err  # said, not silent
    assert not (out / "eval.json").exists()
    metrics = json.loads((out / METRICS_FILE).read_text())
    assert metrics["step"] == 3 and len(metrics["train_loss"]) == 3  # this run's, not the old
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


@pytest.mark.parametrize(
    ("scheme", "positional"),
    [("fox", None), ("cope", None), ("fire", None), ("rope", '{"fraction": 0.75}')],
)
def test_the_new_schemes_train_on_the_tiny_preset(
    small_corpus: Corpus, tmp_path: Path, scheme: str, positional: str | None
) -> None:
    """A few steps of `ordinal train --preset tiny` per new scheme (rope at 0.75 is `prope`):
    finite losses, a checkpoint that loads with the scheme and its parameters."""
    argv = ["train", "--preset", "tiny", "--scheme", scheme, "--out", str(tmp_path / "ck")]
    argv += ["--tokenizer", str(tmp_path / "tok.json"), "--state-dir", str(tmp_path / "state")]
    argv += ["--steps", "3", "--threads", "1"]
    assert main([*argv, *(["--positional", positional] if positional else [])]) == 0
    metrics = json.loads((tmp_path / "ck" / METRICS_FILE).read_text())
    assert len(metrics["train_loss"]) == 3 and all(math.isfinite(x) for x in losses(metrics))
    assert "init" not in metrics
    loaded = load_checkpoint(tmp_path / "ck", device="cpu").model
    assert loaded.config.scheme == scheme
    assert loaded.config.positional == {"scheme": scheme, **json.loads(positional or "{}")}


@pytest.mark.skipif(
    shutil.which("torchrun", path=Path(sys.executable).parent) is None
    and shutil.which("torchrun") is None,
    reason="torchrun is not installed",
)
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_torchrun_two_processes_follow_one_process_loss_curve(
    tmp_path: Path, tokenizer_path: Path, small_corpus: Corpus, optimizer: str
) -> None:
    """Same global batch (8: 4 per process), same seed, dropout 0: the loss curve, validation
    losses and final weights of DDP over gloo equal one process's within rounding."""
    (tmp_path / "config.json").write_text(json.dumps({"model": {"dropout": 0.0}}))
    extra = ["--config", str(tmp_path / "config.json"), "--storage-dtype", "float32"]
    extra += ["--steps", "8", "--eval-every", "4", "--optimizer", optimizer]
    one = lab.train.run(train_args(tmp_path / "one", tokenizer_path, *extra))

    args = train_args(tmp_path / "two", tokenizer_path, *extra)
    argv = ["train", "--scheme", "rope", *to_flags(args)]
    command = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "-m", __name__, *argv]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("step 8: val loss") == 1  # printed by rank 0 only
    two = json.loads((tmp_path / "two" / "ck" / METRICS_FILE).read_text())

    assert [step for step, _ in two["train_loss"]] == list(range(1, 9))
    # AdamW: float32 all the way, so the curves agree to the 4 places they are rounded to. Muon
    # orthogonalises each update in bfloat16 (below), so the all-reduce's float32 rounding, which
    # differs from one process's sum in an order that varies by CPU, can flip a bfloat16 rounding
    # of the update: the losses then agree to that precision, 2⁻⁸ of an update's effect (after
    # 8 steps, 3e-4 apart on an AMD EPYC, within 2e-4 on a Xeon).
    tolerance = 2e-4 if optimizer == "adamw" else 2e-3
    np.testing.assert_allclose(losses(two), losses(one), atol=tolerance)
    np.testing.assert_allclose(
        [v for _, v in two["val_loss"]], [v for _, v in one["val_loss"]], atol=tolerance
    )
    assert two["tokens_seen"] == one["tokens_seen"]
    one_model, _ = load_checkpoint(tmp_path / "one" / "ck", device="cpu")
    two_model, _ = load_checkpoint(tmp_path / "two" / "ck", device="cpu")
    if optimizer == "adamw":
        torch.testing.assert_close(
            two_model.state_dict(), one_model.state_dict(), atol=1e-5, rtol=1e-4
        )
        return
    # torch.optim.Muon orthogonalises each update in bfloat16, so a float32 rounding difference
    # in the all-reduced gradient can flip a bf16 rounding: the weights agree to bf16's relative
    # precision (2⁻⁸ ≈ 0.4%) of the updates, not to float32's: measured ≤ 1.1% over these 8
    # steps, against ~100% for an unrelated run.
    for name, weight in one_model.state_dict().items():
        drift = (two_model.state_dict()[name] - weight).norm() / weight.norm()
        assert drift < 2**-5, name


def to_flags(args: argparse.Namespace) -> list[str]:
    """The ``ordinal train`` flags that reproduce ``args`` (given options only)."""
    flags = []
    for name, value in vars(args).items():
        if name == "scheme" or value is None or value is False:
            continue
        flags += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return flags


def run_on_the_small_corpus(argv: Sequence[str]) -> int:
    """``ordinal ARGV`` with the small corpus: what each torchrun process runs."""
    corpus = small()
    lab.train.load_corpus = lambda: corpus  # type: ignore[assignment]
    return main(argv)


if __name__ == "__main__":
    sys.exit(run_on_the_small_corpus(sys.argv[1:]))


def test_the_weight_average_is_the_closed_form_on_a_toy_parameter() -> None:
    """a_n = d^(n−s−1)·θ_(s+1) + (1 − d)·Σ_(t=s+2..n) d^(n−t)·θ_t, s = ema_start_step."""
    toy = torch.nn.Linear(1, 1, bias=False)
    recipe = model.config.TrainConfig(steps=10, ema_decay=0.7, ema_start=0.4)
    start = recipe.ema_start_step
    assert start == 4
    average = lab.train.WeightAverage(toy, recipe)
    values = {done: float(done**2 - 3 * done) for done in range(1, recipe.steps + 1)}
    for done, value in values.items():
        with torch.no_grad():
            toy.weight.fill_(value)  # as if step `done` had set it
        average.update(toy, done)
    decay, last = recipe.ema_decay, recipe.steps
    expected = decay ** (last - start - 1) * values[start + 1] + (1 - decay) * sum(
        decay ** (last - t) * values[t] for t in range(start + 2, last + 1)
    )
    assert toy.weight.item() == values[last]  # updating the average leaves the model alone
    average.read_out(toy)
    assert toy.weight.item() == pytest.approx(expected, rel=1e-6)


def test_a_run_with_the_weight_average_saves_the_average_at_its_last_step(
    tmp_path: Path, tokenizer_path: Path, full_run: tuple[dict[str, Any], Path]
) -> None:
    extra = ("--ema-decay", "0.8", "--ema-start", "0.5")
    metrics = lab.train.run(train_args(tmp_path, tokenizer_path, *extra))
    assert metrics["train"]["ema_decay"] == 0.8
    state = torch.load(tmp_path / "state" / STATE_FILE, weights_only=False)
    assert int(state["average"]["n_averaged"]) == STEPS - STEPS // 2
    averaged = {
        name.removeprefix("module."): tensor
        for name, tensor in state["average"].items()
        if name != "n_averaged"
    }
    saved = load_checkpoint(tmp_path / "ck", device="cpu").model.state_dict()
    for name, tensor in averaged.items():  # the checkpoint (bfloat16) holds the average
        torch.testing.assert_close(saved[name].float(), tensor.bfloat16().float())
    raw = torch.load(full_run[1] / "state" / STATE_FILE, weights_only=False)["model"]
    assert any(not torch.equal(raw[name], tensor) for name, tensor in averaged.items())


def test_bfloat16_precision_autocasts_the_forward_but_keeps_a_float32_loss() -> None:
    """``precision="bfloat16"`` runs the products in bfloat16 (so the loss moves, a little) and
    leaves the weights, their gradients and the loss in float32; an unknown precision is a
    config error naming the field."""
    torch.manual_seed(0)
    config = model.config.ModelConfig(
        vocab_size=64, d_model=32, n_layers=1, n_heads=2, d_ff=64, context_length=16
    )
    net = Transformer(config)
    inputs = torch.randint(0, 64, (2, 16))
    targets = torch.randint(0, 64, (2, 16))
    full = lab.train.summed_loss(net, inputs, targets)
    mixed = lab.train.summed_loss(net, inputs, targets, autocast=True)
    assert full.dtype == mixed.dtype == torch.float32
    assert mixed.item() != full.item()
    assert mixed.item() == pytest.approx(full.item(), rel=2e-2)
    mixed.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in net.parameters())
    assert model.config.TrainConfig(precision="bfloat16").precision == "bfloat16"
    with pytest.raises(model.config.ConfigError, match=r"train\.precision"):
        model.config.TrainConfig(precision="float16")


def test_compile_without_a_cpu_compiler_trains_uncompiled_and_says_so(
    tmp_path: Path,
    tokenizer_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The shipped recipe compiles; on a CPU without a C++ compiler (a slim image) torch.compile
    would fail at the first step, so the run goes on uncompiled and its metrics say so."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    metrics = lab.train.run(train_args(tmp_path, tokenizer_path, "--compile"))
    assert metrics["train"]["compile"] is False
    assert "no-such-compiler not found" in capsys.readouterr().err
    assert np.mean(losses(metrics)[-5:]) < np.mean(losses(metrics)[:5])
