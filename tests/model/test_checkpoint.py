"""Checkpoints round-trip exactly, name the tensor that is wrong in a damaged or mismatched file,
and survive a save that is killed half way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from model.checkpoint import (
    WEIGHTS_FILE,
    CheckpointError,
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
    (path / "metrics.json").write_text('{"bpc": 2.5}')
    newer = random_model("alibi", seed=7)
    save_checkpoint(path, newer, tiny_tokenizer)
    assert (path / "metrics.json").read_text() == '{"bpc": 2.5}'
    assert torch.equal(logits_of(load(path)), logits_of(newer))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging or retired folder left


def test_missing_file_is_named(tmp_path: Path, tiny_tokenizer) -> None:
    save_checkpoint(tmp_path / "ckpt", random_model("none", seed=8), tiny_tokenizer)
    (tmp_path / "ckpt" / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is missing"):
        load(tmp_path / "ckpt")


def header_of(path: Path) -> dict:
    """The safetensors header: name → {dtype, shape, data_offsets}."""
    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    header.pop("__metadata__", None)
    return header


@pytest.fixture
def saved(tmp_path: Path, tiny_tokenizer) -> Path:
    """A saved float32 t5 checkpoint (t5 has a positional table and a bias table)."""
    path = tmp_path / "ckpt"
    save_checkpoint(path, random_model("t5", seed=9), tiny_tokenizer)
    return path


@pytest.mark.parametrize("kept_fraction", [0.999, 0.5, 0.1])
def test_truncated_weights_name_a_tensor_that_was_cut(saved: Path, kept_fraction: float) -> None:
    weights = saved / WEIGHTS_FILE
    raw = weights.read_bytes()
    header_size = 8 + int.from_bytes(raw[:8], "little")
    keep = header_size + int((len(raw) - header_size) * kept_fraction)
    ends = {
        name: header_size + entry["data_offsets"][1] for name, entry in header_of(weights).items()
    }
    cut = {name for name, end in ends.items() if end > keep}
    weights.write_bytes(raw[:keep])
    with pytest.raises(CheckpointError, match="cut short") as error:
        load(saved)
    named = str(error.value).split("'")[1]
    assert named in cut


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


# Runs in a child process: starts saving a new model over the checkpoint at argv[1], writes half
# of model.safetensors, touches argv[2] and hangs there until the test kills it.
KILLED_SAVE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path

    import torch
    from tokenizers import Tokenizer

    import model.checkpoint as checkpoint
    from model.config import ModelConfig
    from model.transformer import Transformer

    path, ready = Path(sys.argv[1]), Path(sys.argv[2])
    real_save_file = checkpoint.save_file

    def save_half_then_hang(tensors, filename, metadata=None):
        real_save_file(tensors, filename, metadata=metadata)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[: len(data) // 2])
        ready.touch()
        time.sleep(600)

    checkpoint.save_file = save_half_then_hang
    torch.manual_seed(1234)
    model = Transformer(ModelConfig.load(path / "config.json"))
    checkpoint.save_checkpoint(path, model, Tokenizer.from_file(str(path / "tokenizer.json")))
    """
)


def test_a_killed_save_leaves_the_previous_checkpoint_intact(
    tmp_path: Path, tiny_tokenizer: Tokenizer
) -> None:
    path, ready = tmp_path / "ckpt", tmp_path / "ready"
    old = random_model("learned", seed=10)
    save_checkpoint(path, old, tiny_tokenizer)
    before = {p.name: p.read_bytes() for p in path.iterdir()}

    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE, str(path), str(ready)], cwd=REPO_ROOT
    )
    try:
        deadline = time.monotonic() + 180  # importing torch can take minutes on a busy machine
        while not ready.exists():
            assert child.poll() is None, "the saving process exited before it was killed"
            assert time.monotonic() < deadline, "the saving process never reached save_file"
            time.sleep(0.05)
    finally:
        child.kill()  # SIGKILL: no cleanup handler runs
        child.wait()

    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert torch.equal(logits_of(load(path)), logits_of(old))
    leftovers = [p for p in tmp_path.iterdir() if p.name not in ("ckpt", "ready")]
    assert leftovers, "the killed save should have left its staging folder behind"
    for staging in leftovers:
        assert staging.name.startswith("."), "a staging folder must not look like a checkpoint"
        with pytest.raises(CheckpointError):
            load(staging)  # half-written: refused, never taken for a checkpoint

    newer = random_model("learned", seed=11)  # the next save still works
    save_checkpoint(path, newer, tiny_tokenizer)
    assert torch.equal(logits_of(load(path)), logits_of(newer))


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
