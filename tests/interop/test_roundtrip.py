"""``ordinal export`` then ``ordinal import``: the checkpoint comes back as it was.

Every shipped checkpoint is exported as custom code (each scheme, p-RoPE and DroPE), and rope
(Nemotron), learned, none and DroPE (GPT-2) also natively; so is each tiny random bfloat16
checkpoint of what none ships (conftest.TINY_CHECKPOINTS: irope's window, stick-breaking's biases,
pope's base and phase biases past its clamp).
Each folder is imported back and must give the same config, every tensor bit for bit in the
stored dtype (bfloat16: the weights file's data identical), the same tokenizer and chat
template, and logits equal to the original's. The GPT-2 exports of mds and lowrank baked their
parameters into a position table: their import is refused, saying so. A folder edited after the
export is refused where the edit makes it another model than its ``ordinal_config`` (p-RoPE's
fraction dropped from config.json among them), and a custom-code folder trained on since imports
in float32 only when asked (``--dtype``), never rounded silently.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ordinal
from interop.hf_export import NATIVE, export_folder
from interop.hf_import import EXPORT_INVERSES
from model.checkpoint import data_section, load_checkpoint
from model.generate import encode_prompt
from tests.interop.conftest import TINY_CHECKPOINTS
from tests.test_shipped_checkpoints import SHIPPED_MODELS

SHIPPED = Path(__file__).resolve().parents[2] / "checkpoints"
# (scheme, --target) of every folder that must import back exactly.
EXACT = [(name, "custom") for name in SHIPPED_MODELS] + [
    ("rope", "auto"),  # NemotronForCausalLM
    ("learned", "auto"),  # GPT2LMHeadModel, the table as GPT-2's
    ("none", "auto"),  # GPT2LMHeadModel, a table of zeros
    ("drope", "auto"),  # likewise (none's scheme)
]
LOSSY = ["mds", "lowrank"]  # their GPT2LMHeadModel exports

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """Each (scheme, target) of EXACT and LOSSY: the folder ``ordinal export`` wrote."""
    root = tmp_path_factory.mktemp("exports")
    folders = {}
    for scheme, target in [*EXACT, *((scheme, "auto") for scheme in LOSSY)]:
        folders[scheme, target] = root / f"{scheme}-{target}"
        export_folder(SHIPPED / scheme, folders[scheme, target], target)
    return folders


def import_back(folder: Path, out: Path, *options: str) -> None:
    assert ordinal.main(["import", str(folder), str(out), *options]) == 0


@pytest.mark.parametrize(("scheme", "target"), EXACT)
def test_an_export_imports_back_as_the_checkpoint_it_came_from(
    scheme: str, target: str, exports: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    folder = exports[scheme, target]
    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    assert (architecture in NATIVE) == (target == "auto")
    assert_imports_back_exactly(SHIPPED / scheme, folder, tmp_path / "back")


@pytest.mark.parametrize("scheme", TINY_CHECKPOINTS)
def test_a_scheme_without_a_shipped_checkpoint_imports_back_exactly(
    scheme: str, tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    checkpoint = tiny_checkpoints[scheme]
    assert not export_folder(checkpoint, tmp_path / "hf").native  # auto: custom code
    assert_imports_back_exactly(checkpoint, tmp_path / "hf", tmp_path / "back")


def assert_imports_back_exactly(checkpoint: Path, folder: Path, out: Path) -> None:
    """``folder``, exported from the bfloat16 ``checkpoint``, imports back to ``out`` as it."""
    import_back(folder, out)
    original, back = (load_checkpoint(path, device="cpu") for path in (checkpoint, out))
    assert back.model.config == original.model.config  # bfloat16 again, as it was trained
    stored = [load_file(path / "model.safetensors") for path in (checkpoint, out)]
    assert stored[0].keys() == stored[1].keys()
    for name, tensor in stored[0].items():
        assert stored[1][name].dtype == tensor.dtype == torch.bfloat16, name
        assert torch.equal(stored[1][name].view(torch.int16), tensor.view(torch.int16)), name
    # Bit for bit: the weights file's data (every stored tensor's bytes) is the original's.
    weights = [(path / "model.safetensors").read_bytes() for path in (checkpoint, out)]
    assert data_section(weights[0]) == data_section(weights[1])
    # The same tokenizer, and the chat template without the prelude the export put before it.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert json.loads((out / name).read_text()) == json.loads(
            (checkpoint / name).read_text()
        ), name
    tokens = torch.tensor(
        [encode_prompt(original.tokenizer, "What light through yonder window breaks?")]
    )
    with torch.no_grad():
        assert torch.equal(back.model(tokens), original.model(tokens))


@pytest.mark.parametrize("scheme", LOSSY)
def test_a_lossy_gpt2_export_is_refused_saying_why(
    scheme: str,
    exports: dict[tuple[str, str], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = exports[scheme, "auto"]
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert ordinal.main(["import", str(folder), str(tmp_path / "back")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("ordinal import: error: ") and "Traceback" not in error
    assert f"export of {scheme} is lossy" in error and "baked into GPT-2's position table" in error
    assert "--target custom" in error
    assert not (tmp_path / "back").exists()


def edited_copy(
    folder: Path, to: Path, config: dict | None = None, tensor: str | None = None
) -> Path:
    """``folder`` copied to ``to`` with config.json's keys changed and one tensor nudged."""
    shutil.copytree(folder, to)
    if config:
        path = to / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensor:
        tensors = load_file(to / "model.safetensors")
        tensors[tensor] = tensors[tensor].clone()
        tensors[tensor].view(-1)[0] += 1e-3
        save_file(tensors, to / "model.safetensors", metadata={"format": "pt"})
    return to


@pytest.mark.parametrize(
    ("export", "config", "tensor", "named"),
    [
        (("rope", "auto"), {"rope_theta": 500.0}, None, "rope_theta"),
        (("rope", "auto"), None, "model.layers.0.input_layernorm.bias", "input_layernorm.bias"),
        (("learned", "auto"), None, "transformer.h.1.attn.c_attn.bias", "attn.c_attn.bias"),
        (("none", "auto"), None, "transformer.wpe.weight", "transformer.wpe.weight"),
        (("alibi", "custom"), {"n_heads": 2}, None, "n_heads"),
        (("prope", "custom"), {"positional": {"scheme": "rope"}}, None, "positional"),
        (("alibi", "custom"), {"architectures": ["NemotronForCausalLM"]}, None, "alibi"),
        (("learned", "custom"), {"architectures": ["GPT2LMHeadModel"]}, None, "wte.weight"),
    ],
)
def test_a_folder_edited_into_another_model_is_refused_by_name(
    export: tuple[str, str],
    config: dict | None,
    tensor: str | None,
    named: str,
    exports: dict[tuple[str, str], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Zero biases the checkpoint has no place for, none's zero table, a config the weights
    were not exported with: importing any of them would give another model than the folder's."""
    folder = edited_copy(exports[export], tmp_path / "edited", config, tensor)
    assert ordinal.main(["import", str(folder), str(tmp_path / "back")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("ordinal import: error: ") and named in error, error
    assert not (tmp_path / "back").exists()


def test_weights_changed_since_are_kept_in_float32_only_when_asked(
    exports: dict[tuple[str, str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A custom-code folder computes from its own tensors, so a tensor trained on since is the
    model; it is no longer bfloat16, so importing it as its checkpoint's dtype would round it."""
    name = "blocks.0.attention.qkv.weight"
    folder = edited_copy(exports["t5", "custom"], tmp_path / "tuned", tensor=name)
    assert ordinal.main(["import", str(folder), str(tmp_path / "back")]) == 2
    error = capsys.readouterr().err
    assert name in error and "--dtype float32" in error
    assert not (tmp_path / "back").exists()

    import_back(folder, tmp_path / "back", "--dtype", "float32")
    back = load_checkpoint(tmp_path / "back", device="cpu", dtype="float32").model
    original = load_checkpoint(SHIPPED / "t5", device="cpu").model
    assert back.config == original.config.replace(dtype="float32")
    tuned = load_file(folder / "model.safetensors")
    for key, tensor in back.state_dict().items():
        if key != "lm_head.weight":  # tied: not stored
            assert torch.equal(tensor, tuned[key]), key
    assert not torch.equal(back.state_dict()[name], original.state_dict()[name].float())


def test_every_native_export_has_its_inverse() -> None:
    assert set(EXPORT_INVERSES) == set(NATIVE)
