"""Checkpoints round-trip exactly, name the tensor that is wrong in a damaged or mismatched file,
refuse weights that fail their SHA-256 checksum, and survive a save killed at any step."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save, save_file

import model.checkpoint as checkpoint
from model.checkpoint import (
    EXCHANGE_STEPS,
    FIRST_SAVE_STEPS,
    RENAME_STEPS,
    SAVE_STEPS,
    WEIGHTS_FILE,
    CheckpointError,
    UnverifiedWeightsWarning,
    data_section,
    load_checkpoint,
    save_checkpoint,
    stored_tensors,
)
from model.config import ConfigError
from model.transformer import Transformer
from tests.model.conftest import ALL_SCHEMES, random_model, random_tokens, tiny_config

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENS = random_tokens(2, 20, seed=100)


def logits_of(model: Transformer, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)


def load(path: Path, **options) -> Transformer:
    return load_checkpoint(path, device="cpu", **options).model


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_float32_round_trip_is_exact(scheme: str, tmp_path: Path, tiny_tokenizer) -> None:
    model = random_model(scheme, seed=1)
    save_checkpoint(tmp_path / "ckpt", model, tiny_tokenizer)
    loaded, tokenizer = load_checkpoint(tmp_path / "ckpt", device="cpu")
    assert loaded.config == model.config
    assert not loaded.training
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert torch.equal(logits_of(loaded), logits_of(model))
    text = "Fair is foul, and foul is fair"
    assert tokenizer.encode(text).ids == tiny_tokenizer.encode(text).ids


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_bfloat16_storage_loads_the_rounded_weights(
    scheme: str, tmp_path: Path, tiny_tokenizer
) -> None:
    model = random_model(scheme, seed=2)
    save_checkpoint(tmp_path / "ckpt", model, tiny_tokenizer, dtype="bfloat16")
    loaded = load(tmp_path / "ckpt")  # run dtype float32
    assert loaded.config.dtype == "bfloat16"
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.copy_(tensor.to(torch.bfloat16).float())
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, model.state_dict()[name]), name
    assert torch.equal(logits_of(loaded), logits_of(model))


def test_run_dtype_is_independent_of_the_stored_dtype(tmp_path: Path, tiny_tokenizer) -> None:
    model = random_model("rope", seed=3)
    save_checkpoint(tmp_path / "f32", model, tiny_tokenizer)
    save_checkpoint(tmp_path / "bf16", model, tiny_tokenizer, dtype="bfloat16")
    run_bf16 = load(tmp_path / "f32", dtype="bfloat16")
    run_f32 = load(tmp_path / "bf16", dtype="float32")
    assert run_bf16.config.dtype == "float32" and run_f32.config.dtype == "bfloat16"
    assert {p.dtype for p in run_bf16.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in run_f32.parameters()} == {torch.float32}
    torch.testing.assert_close(logits_of(run_bf16).float(), logits_of(model), atol=0.2, rtol=0)
    with pytest.raises(ConfigError, match="dtype must be one of"):
        load(tmp_path / "f32", dtype="float64")


def test_positional_overrides_apply_at_load_time(tmp_path: Path, tiny_tokenizer) -> None:
    model = random_model("rope", seed=4)
    save_checkpoint(tmp_path / "ckpt", model, tiny_tokenizer)
    ntk = {"scaling": "ntk", "scaling_factor": 4.0}
    scaled = load(tmp_path / "ckpt", positional_overrides=ntk)
    assert scaled.config.positional == {"scheme": "rope", **ntk}
    reference = Transformer(tiny_config("rope", positional={"scheme": "rope", **ntk})).eval()
    reference.load_state_dict(model.state_dict())
    long_tokens = random_tokens(1, 60, seed=5)
    assert torch.equal(logits_of(scaled, long_tokens), logits_of(reference, long_tokens))
    unscaled = logits_of(load(tmp_path / "ckpt"), long_tokens)
    assert (logits_of(scaled, long_tokens) - unscaled).abs().max() > 1e-2
    stored = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert stored["positional"] == {"scheme": "rope"}  # the checkpoint itself is untouched
    with pytest.raises(CheckpointError, match=r"config\.json.*'factor'"):
        load(tmp_path / "ckpt", positional_overrides={"factor": 4.0})


def test_other_files_in_the_folder_survive_a_new_save(tmp_path: Path, tiny_tokenizer) -> None:
    path = tmp_path / "ckpt"
    save_checkpoint(path, random_model("alibi", seed=6), tiny_tokenizer)
    (path / "notes.md").write_text("trained on the folio")
    newer = random_model("alibi", seed=7)
    save_checkpoint(path, newer, tiny_tokenizer)
    assert (path / "notes.md").read_text() == "trained on the folio"
    assert torch.equal(logits_of(load(path)), logits_of(newer))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging or retired folder left


def test_the_old_weights_scores_and_metrics_never_reach_a_new_save(
    tmp_path: Path, tiny_tokenizer
) -> None:
    """eval.json and metrics.json describe the weights they were written with: carried into
    the next save, the new model was shown with the old one's scores."""
    path = tmp_path / "ckpt"
    save_checkpoint(path, random_model("alibi", seed=6), tiny_tokenizer)
    (path / "eval.json").write_text('{"results": {"1x": {"bpc": 2.5}}}')
    (path / "metrics.json").write_text('{"val_loss": [[10, 1.5]]}')
    save_checkpoint(path, random_model("alibi", seed=7), tiny_tokenizer)
    assert not (path / "eval.json").exists() and not (path / "metrics.json").exists()
    newest = random_model("alibi", seed=8)
    save_checkpoint(path, newest, tiny_tokenizer, json_files={"metrics.json": 1})
    assert json.loads((path / "metrics.json").read_text()) == 1  # the new run's own


def test_a_folder_that_is_no_checkpoint_is_replaced_whole(tmp_path: Path, tiny_tokenizer) -> None:
    """Forced over a user's folder (``--force``), a save keeps none of its files."""
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "notes.md").write_text("a user's own")
    save_checkpoint(path, random_model("alibi", seed=6), tiny_tokenizer)
    assert not (path / "notes.md").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_missing_file_is_named(tmp_path: Path, tiny_tokenizer) -> None:
    save_checkpoint(tmp_path / "ckpt", random_model("none", seed=8), tiny_tokenizer)
    (tmp_path / "ckpt" / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is missing"):
        load(tmp_path / "ckpt")


@pytest.fixture
def saved(tmp_path: Path, tiny_tokenizer) -> Path:
    """A saved float32 t5 checkpoint (t5 has a positional table and a bias table)."""
    path = tmp_path / "ckpt"
    save_checkpoint(path, random_model("t5", seed=9), tiny_tokenizer)
    return path


@pytest.mark.parametrize("kept_fraction", [0.999, 0.5, 0.1])
def test_truncated_weights_are_refused_naming_the_file(saved: Path, kept_fraction: float) -> None:
    weights = saved / WEIGHTS_FILE
    raw = weights.read_bytes()
    start = data_start(raw)
    weights.write_bytes(raw[: start + int((len(raw) - start) * kept_fraction)])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as error:
        load(saved)
    assert str(error.value).startswith(f"{weights} ")


def test_weights_cut_inside_the_header_are_a_checkpoint_error(saved: Path) -> None:
    weights = saved / WEIGHTS_FILE
    for keep in (0, 5, 40):
        weights.write_bytes(weights.read_bytes()[:keep])
        with pytest.raises(CheckpointError, match="truncated"):
            load(saved)


def rewrite_weights(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(path / WEIGHTS_FILE))
    edit(tensors)
    save_file(tensors, str(path / WEIGHTS_FILE))


MISMATCHES = {
    "wrong shape": (
        lambda t: t.update({"blocks.1.mlp.up.weight": torch.zeros(65, 32)}),
        r"'blocks\.1\.mlp\.up\.weight' has shape \(65, 32\), the config expects \(64, 32\)",
    ),
    "missing": (lambda t: t.pop("final_norm.weight"), r"'final_norm\.weight' is missing"),
    "extra": (
        lambda t: t.update({"blocks.2.attention.qkv.weight": torch.zeros(96, 32)}),
        r"unexpected tensor 'blocks\.2\.attention\.qkv\.weight'",
    ),
    "wrong dtype": (
        lambda t: t.update({"positional.bias_table": t["positional.bias_table"].half()}),
        r"'positional\.bias_table' is stored as float16, config\.json says float32",
    ),
    "scheme's table missing": (
        lambda t: t.pop("positional.bias_table"),
        r"'positional\.bias_table' is missing",
    ),
}


@pytest.mark.parametrize("mismatch", MISMATCHES)
def test_mismatched_weights_name_the_tensor(saved: Path, mismatch: str) -> None:
    edit, message = MISMATCHES[mismatch]
    rewrite_weights(saved, edit)
    with pytest.raises(CheckpointError, match=message):
        load(saved)


def test_weights_of_another_scheme_are_refused(saved: Path) -> None:
    config = json.loads((saved / "config.json").read_text())
    config["positional"] = {"scheme": "learned"}
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"'positional\.table' is missing"):
        load(saved)


def data_start(raw: bytes) -> int:
    """Where a safetensors file's data section begins (after the length and the JSON header)."""
    return 8 + int.from_bytes(raw[:8], "little")


def test_weights_record_the_sha256_of_their_data_section(saved: Path) -> None:
    raw = (saved / WEIGHTS_FILE).read_bytes()
    with safe_open(saved / WEIGHTS_FILE, framework="pt") as weights:
        metadata = weights.metadata()
    assert metadata == {
        "format": "pt",
        "sha256": hashlib.sha256(raw[data_start(raw) :]).hexdigest(),
    }
    # The layout the digest rests on: the data section does not depend on the metadata.
    unsigned = save(load_file(str(saved / WEIGHTS_FILE)), metadata={"format": "pt"})
    assert unsigned[data_start(unsigned) :] == raw[data_start(raw) :]
    assert bytes(data_section(raw)) == raw[data_start(raw) :]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a checkpoint with a checksum loads without a warning
        load(saved)


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_flipped_weight_bytes_are_refused_by_the_checksum(saved: Path, where: float) -> None:
    weights = saved / WEIGHTS_FILE
    raw = bytearray(weights.read_bytes())
    start = data_start(raw)
    at = min(start + int((len(raw) - start) * where), len(raw) - 3)
    for index in range(at, at + 3):  # inside the weights: the header still reads fine
        raw[index] ^= 0x5A
    weights.write_bytes(raw)
    message = f"{weights}: weights do not match their SHA-256 checksum (the file is corrupt)"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load(saved)


def test_weights_without_a_checksum_load_with_a_warning(saved: Path) -> None:
    reference = logits_of(load(saved))
    rewrite_weights(saved, lambda tensors: None)  # save_file writes no metadata
    with pytest.warns(UnverifiedWeightsWarning, match=re.escape(f"{saved / WEIGHTS_FILE} has no")):
        unverified = load(saved)
    assert torch.equal(logits_of(unverified), reference)


def test_a_file_that_is_not_safetensors_is_named(saved: Path) -> None:
    weights = saved / WEIGHTS_FILE
    weights.write_text('{"these": "are not weights"}')
    with pytest.raises(CheckpointError, match="not a readable safetensors file") as error:
        load(saved)
    assert str(error.value).startswith(f"{weights} is truncated or corrupt")


def test_stored_tensors_skip_the_tied_output_matrix(tiny_tokenizer, tmp_path: Path) -> None:
    tied, untied = random_model("rope", seed=12), random_model("rope", 12, tie_embeddings=False)
    assert "lm_head.weight" not in stored_tensors(tied)
    assert "lm_head.weight" in stored_tensors(untied)
    save_checkpoint(tmp_path / "untied", untied, tiny_tokenizer)
    loaded = load(tmp_path / "untied")
    assert loaded.lm_head.weight is not loaded.token_embedding.weight
    assert torch.equal(logits_of(loaded), logits_of(untied))
    assert os.listdir(tmp_path) == ["untied"]


def test_loading_keeps_the_column_major_weight_layout_and_the_tie(
    tmp_path: Path, tiny_tokenizer
) -> None:
    save_checkpoint(tmp_path / "ckpt", random_model("rope", seed=2), tiny_tokenizer)
    loaded = load(tmp_path / "ckpt", dtype="bfloat16")
    linears = [m for m in loaded.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.t().is_contiguous() for m in linears)
    assert loaded.lm_head.weight is loaded.token_embedding.weight


# ----------------------------------------------------------------------------------------------
# The save protocol: steps, clean-up after killed saves, and a save killed at every step.


def hidden(folder: Path) -> list[str]:
    """The temporary folders of saves in ``folder`` (every name starting with a dot)."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def same_weights(model: Transformer, other: Transformer) -> bool:
    state, other_state = model.state_dict(), other.state_dict()
    return state.keys() == other_state.keys() and all(
        torch.equal(tensor, other_state[name]) for name, tensor in state.items()
    )


def files_of(folder: Path) -> dict[str, bytes]:
    return {file.name: file.read_bytes() for file in folder.iterdir()}


def exchange_works(folder: Path) -> bool:
    """Whether renameat2(RENAME_EXCHANGE) swaps two folders on ``folder``'s filesystem."""
    first, second = folder / "exchange-a", folder / "exchange-b"
    first.mkdir()
    second.mkdir()
    (first / "from-a").touch()
    try:
        return checkpoint._exchange(first, second) and (second / "from-a").exists()
    finally:
        for each in (first, second):
            (each / "from-a").unlink(missing_ok=True)
            each.rmdir()


def test_exchange_swaps_two_folders_in_one_step(tmp_path: Path) -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("renameat2 is Linux's; saves here use the two-rename fallback")
    if not exchange_works(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses RENAME_EXCHANGE: saves use the fallback")
    with pytest.raises(FileNotFoundError):
        checkpoint._exchange(tmp_path / "absent", tmp_path / "also-absent")


def test_each_save_reports_the_steps_of_its_protocol(
    tmp_path: Path, tiny_tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, steps = tmp_path / "ckpt", []
    save_checkpoint(path, random_model("none", seed=20), tiny_tokenizer, on_step=steps.append)
    assert steps == list(FIRST_SAVE_STEPS)
    if exchange_works(tmp_path):
        steps.clear()
        save_checkpoint(path, random_model("none", seed=21), tiny_tokenizer, on_step=steps.append)
        assert steps == list(EXCHANGE_STEPS)
    monkeypatch.setattr(checkpoint, "_exchange", lambda first, second: False)
    steps.clear()
    newest = random_model("none", seed=22)
    save_checkpoint(path, newest, tiny_tokenizer, on_step=steps.append)
    assert steps == list(RENAME_STEPS)
    assert set(FIRST_SAVE_STEPS + EXCHANGE_STEPS + RENAME_STEPS) == set(SAVE_STEPS)
    assert same_weights(load(path), newest)
    assert hidden(tmp_path) == []


def test_a_failing_fallback_rename_puts_the_old_checkpoint_back(
    tmp_path: Path, tiny_tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, old = tmp_path / "ckpt", random_model("none", seed=23)
    save_checkpoint(path, old, tiny_tokenizer)
    monkeypatch.setattr(checkpoint, "_exchange", lambda first, second: False)

    def fail_after_retiring(step: str) -> None:
        if step == "retired":
            raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        save_checkpoint(
            path, random_model("none", seed=24), tiny_tokenizer, on_step=fail_after_retiring
        )
    assert same_weights(load(path), old)
    assert hidden(tmp_path) == []


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def make_leftover(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def test_the_next_save_restores_a_checkpoint_retired_by_a_killed_save(
    tmp_path: Path, tiny_tokenizer
) -> None:
    """The fallback's one gap: killed between its two renames, nothing is at the path."""
    path = tmp_path / "ckpt"
    save_checkpoint(path, random_model("alibi", seed=25), tiny_tokenizer)
    (path / "notes.md").write_text("the old one's")
    pid = dead_pid()
    path.rename(tmp_path / f".ckpt.old-{pid}")
    make_leftover(tmp_path / f".ckpt.saving-{pid}")
    newer = random_model("alibi", seed=26)
    save_checkpoint(path, newer, tiny_tokenizer)
    assert same_weights(load(path), newer)
    assert (path / "notes.md").read_text() == "the old one's"  # carried over from the old one
    assert hidden(tmp_path) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="zombies are seen in /proc")
def test_leftovers_of_dead_saves_are_removed_and_those_of_live_ones_kept(
    tmp_path: Path, tiny_tokenizer
) -> None:
    path = tmp_path / "ckpt"
    save_checkpoint(path, random_model("none", seed=27), tiny_tokenizer)
    live = subprocess.Popen(["sleep", "300"])
    zombie = subprocess.Popen(["sleep", "300"])
    try:
        zombie.kill()
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped yet
        pids = {"live": live.pid, "zombie": zombie.pid, "dead": dead_pid()}
        for pid in pids.values():
            for kind in ("saving", "old"):
                make_leftover(tmp_path / f".ckpt.{kind}-{pid}")
        others = [f".ckpt.saving-{pids['dead']}x", f".other.saving-{pids['dead']}", ".ckpt.keep"]
        for name in others:
            make_leftover(tmp_path / name)  # not a temporary folder of this path's saves
        load(path)
        kept = [f".ckpt.old-{pids['live']}", f".ckpt.saving-{pids['live']}", *others]
        assert hidden(tmp_path) == sorted(kept)
        live.kill()
        live.wait()
        save_checkpoint(path, random_model("none", seed=28), tiny_tokenizer)
        assert hidden(tmp_path) == sorted(others)
    finally:
        for child in (live, zombie):
            child.kill()
            child.wait()


def killed_save(path: Path, source: Path, protocol: str, kill_at: str) -> None:
    """Runs in a child process: saves the checkpoint at ``source`` over the one at ``path`` and
    SIGKILLs itself at step ``kill_at`` of the save protocol (``"writing"``: half way through
    writing model.safetensors, before any step). Exits with a message if the save finished."""

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def write_half_then_die(file: Path, data: bytes) -> None:
        file.write_bytes(data[: len(data) // 2])
        die()

    if protocol == "rename":
        checkpoint._exchange = lambda first, second: False
    if kill_at == "writing":
        checkpoint._write_file = write_half_then_die

    def on_step(step: str) -> None:
        if step == kill_at:
            die()

    model, tokenizer = load_checkpoint(source, device="cpu")
    save_checkpoint(path, model, tokenizer, on_step=on_step)
    sys.exit(f"the save finished without reaching {kill_at}")


KILL_POINTS = [
    ("exchange", "writing"),
    *(("exchange", step) for step in EXCHANGE_STEPS),
    *(("rename", step) for step in RENAME_STEPS),
]
OLD_AT_THE_PATH = {"writing", "staged", "retired"}  # killed before the new one went in


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer):
    """One child per kill point, all run at once: → (root, old model, new model, results).

    The children fork from the session's forkserver, which has imported torch once (the
    server tests' engines fork from the same one), instead of each importing torch afresh as a
    new interpreter would; never plain fork: this process's thread pools are not fork-safe."""
    savers = multiprocessing.get_context("forkserver")
    savers.set_forkserver_preload([__name__])  # only if no forkserver runs yet in this session
    root = tmp_path_factory.mktemp("killed-saves")
    old, new = random_model("learned", seed=10), random_model("learned", seed=11)
    source = root / "new" / "ckpt"
    save_checkpoint(source, new, tiny_tokenizer)
    points = [p for p in KILL_POINTS if p[0] == "rename" or exchange_works(root)]
    children, before = {}, {}
    for protocol, step in points:
        path = root / f"{protocol}-{step}" / "ckpt"
        save_checkpoint(path, old, tiny_tokenizer)
        (path / "notes.md").write_text("the old one's")
        before[protocol, step] = files_of(path)
        children[protocol, step] = child = savers.Process(
            target=killed_save, args=(path, source, protocol, step)
        )
        child.start()
    results = {}
    try:
        for point, child in children.items():
            child.join(timeout=600)  # a busy machine is slow, but each save is small
            results[point] = (child.exitcode, before[point])
    finally:
        for child in children.values():
            child.kill()
            child.join()
    return root, old, new, results


@pytest.mark.parametrize(
    ("protocol", "kill_at"), KILL_POINTS, ids=[f"{p}-{s}" for p, s in KILL_POINTS]
)
def test_a_save_killed_at_each_step_leaves_a_loadable_checkpoint(
    killed_saves, protocol: str, kill_at: str, tiny_tokenizer
) -> None:
    root, old, new, results = killed_saves
    if (protocol, kill_at) not in results:
        pytest.skip("this filesystem refuses RENAME_EXCHANGE")
    exit_code, old_files = results[protocol, kill_at]
    assert exit_code == -signal.SIGKILL, f"exit code {exit_code}"
    folder = root / f"{protocol}-{kill_at}"
    path = folder / "ckpt"
    assert path.is_dir() == (kill_at != "retired")  # the fallback's gap, closed by the next load
    if kill_at == "writing":
        (staging,) = hidden(folder)
        with pytest.raises(CheckpointError):
            load(folder / staging)  # half-written: refused, never taken for a checkpoint

    loaded = load(path)
    if kill_at in OLD_AT_THE_PATH:
        assert files_of(path) == old_files  # untouched, byte for byte
    assert same_weights(loaded, old if kill_at in OLD_AT_THE_PATH else new)
    assert (path / "notes.md").read_text() == "the old one's"
    assert hidden(folder) == []  # the load cleaned up after the killed save

    newest = random_model("learned", seed=12)
    save_checkpoint(path, newest, tiny_tokenizer)
    assert same_weights(load(path), newest)
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt"]


class Killed(BaseException):
    """Stands in for the process dying at a step of a save."""


def test_json_files_change_in_the_same_swap_as_the_weights(saved: Path, tiny_tokenizer) -> None:
    """Training's metrics.json goes into the staged folder: a save killed before the swap leaves
    old weights with old metrics, and one that completes new with new; never new weights
    with old metrics (nor the other way round)."""
    save_checkpoint(saved, random_model("t5", seed=9), tiny_tokenizer, json_files={"m.json": 1})
    old_weights = (saved / WEIGHTS_FILE).read_bytes()

    def kill(step: str) -> None:
        if step == "staged":
            raise Killed

    with pytest.raises(Killed):
        save_checkpoint(
            saved,
            random_model("t5", seed=3),
            tiny_tokenizer,
            json_files={"m.json": 2},
            on_step=kill,
        )
    assert (saved / WEIGHTS_FILE).read_bytes() == old_weights
    assert json.loads((saved / "m.json").read_text()) == 1
    save_checkpoint(saved, random_model("t5", seed=3), tiny_tokenizer, json_files={"m.json": 2})
    assert (saved / WEIGHTS_FILE).read_bytes() != old_weights
    assert json.loads((saved / "m.json").read_text()) == 2


def test_a_killed_atomic_writes_temporary_file_is_not_carried_along(
    saved: Path, tiny_tokenizer
) -> None:
    (saved / "notes.md").write_text("kept")
    (saved / ".eval.json.k1x2.tmp").write_text("half an eval")  # what a killed eval --save left
    save_checkpoint(saved, random_model("t5", seed=4), tiny_tokenizer)
    assert (saved / "notes.md").read_text() == "kept"
    assert not [file.name for file in saved.iterdir() if file.name.startswith(".")]
