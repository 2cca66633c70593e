"""``ordinal export``: what transformers and the gguf library read back from an export computes,
tokenizes and renders what ordinal does.

Every shipped checkpoint (each scheme, p-RoPE and DroPE) is exported (native architecture where
exact, else custom code) and loaded by ``AutoModelForCausalLM`` from the folder alone (no hub):
logits within 1e-4 of ordinal's in float32 over 300 tokens (a table scheme's 128 rows), the same 50
greedy tokens from ``generate()`` with its KV cache (holding keys as wide as ordinal's cache does:
pope's twice a head's width), ``AutoTokenizer``'s ids ordinal's (BOS included), and
``apply_chat_template`` the server's scene. The custom-code port is checked for every one of them
too, on a left-padded batch. Tiny random checkpoints cover configs the shipped ones do not have
(biases, GELU, partial rotation, rope scalings, p-RoPE with yarn, untied output; CoPE past its
table's last row, FIRE without its log or its division; irope's NoPE layers, sliding window and
temperature, stick-breaking and pope; RMSNorm, SwiGLU and qk_norm, which no native architecture
has); those of conftest.TINY_CHECKPOINTS (irope's window and temperature, stick-breaking's biases,
pope's base and phase biases past its clamp) get every check a shipped one gets, and are refused by
every native target and by GGUF, saying why. The port reads every parameter of every scheme it
lists, and a scheme it lacks is refused by name. The GGUF file is read back with
``gguf.GGUFReader``: metadata, the vocabulary and merges, and every tensor.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

import ordinal
from interop.gguf_export import export_gguf
from interop.hf_export import (
    CUSTOM_ARCHITECTURE,
    FOLDER_FILES,
    FORMATS,
    PORTED_SCHEMES,
    REMOTE_FILES,
    TARGETS,
    ExportError,
    export_folder,
    export_model,
)
from model.chat import ChatTemplate, Message
from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import ModelConfig
from model.generate import decode_tokens, encode_prompt
from model.positional import SCHEMES
from model.tokenizer import load_tokenizer
from model.transformer import Transformer
from tests.interop.conftest import TINY_CHECKPOINTS
from tests.model.conftest import random_model, tree_digest
from tests.test_shipped_checkpoints import SHIPPED_MODELS

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "checkpoints"
NATIVE = {
    "rope": "NemotronForCausalLM",
    "none": "GPT2LMHeadModel",
    "learned": "GPT2LMHeadModel",
    "mds": "GPT2LMHeadModel",
    "lowrank": "GPT2LMHeadModel",
    "drope": "GPT2LMHeadModel",  # none's weights, trained with rope first
}
# Without the specials' strings: Hugging Face's tokenizer reads "<|eos|>" in text as the token
# (which its chat template relies on), ordinal's as bytes (text never injects a control token).
TEXT = (SHIPPED / "README.md").read_text().replace("<|", "<")
PROMPT_TOKENS = 300
NEW_TOKENS = 50
MESSAGES = [
    {"role": "system", "content": "A street in Verona."},
    {"role": "user", "content": "What light through yonder window breaks?"},
    {"role": "assistant", "content": "It is the east.", "name": "Nurse"},
    {"role": "user", "content": "Speak again, bright angel!", "name": "Romeo"},
]


def load_hf(folder: Path) -> Any:
    model = AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None  # 50 tokens, as ordinal's raw decode loop
    return model.eval()


def prompt_ids(model: Transformer, tokenizer: Tokenizer, length: int = PROMPT_TOKENS) -> list[int]:
    """``length`` tokens of TEXT (with <|bos|>), or as many as a table scheme has rows."""
    limit = model.positional.max_positions
    return encode_prompt(tokenizer, TEXT)[: length if limit is None else min(length, limit)]


def largest_logit_difference(ordinal_model: Transformer, hf_model: Any, ids: list[int]) -> float:
    tokens = torch.tensor([ids])
    with torch.no_grad():
        return float((ordinal_model(tokens) - hf_model(tokens).logits).abs().max())


def ordinal_greedy(model: Transformer, prompt: list[int], count: int) -> list[int]:
    return [step[0] for step in decode_tokens(model, [prompt], count)]


def assert_generates_as_ordinal(model: Transformer, hf_model: Any, prompt: list[int]) -> None:
    """``generate()`` (greedy, with its KV cache) gives ordinal's NEW_TOKENS tokens, its cache
    holding what ordinal's holds: keys ``key_dim`` wide (pope's twice a head's width, fox's
    with its log gate as one more channel), values a head's."""
    generated = hf_model.generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        return_dict_in_generate=True,
    )
    tokens = generated.sequences[0, len(prompt) :].tolist()
    assert tokens == ordinal_greedy(model, prompt, NEW_TOKENS)
    config, cached = model.config, len(prompt) + NEW_TOKENS - 1  # the last token is never fed
    key_width = config.key_dim + int(model.positional.keeps_key_state)
    for layer in generated.past_key_values.layers:
        assert layer.keys.shape[-2:] == (cached, key_width)
        assert layer.values.shape[-2:] == (cached, config.head_dim)


def assert_left_padded_rows_decode_alone(
    model: Transformer, hf_model: Any, ids: list[int], pad: int
) -> None:
    """Two prompts of different lengths, left-padded: each row decodes as it would alone."""
    prompts, count = [ids[:40], ids[:25]], 12
    width = max(map(len, prompts))
    batch = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    generated = hf_model.generate(
        batch, attention_mask=mask, max_new_tokens=count, do_sample=False, pad_token_id=pad
    )
    for row, prompt in enumerate(prompts):
        assert generated[row, width:].tolist() == ordinal_greedy(model, prompt, count), row


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("exports")


@pytest.mark.parametrize("scheme", SHIPPED_MODELS)
def test_a_shipped_checkpoint_exports_exactly(scheme: str, export_dir: Path) -> None:
    checkpoint = SHIPPED / scheme
    out = export_dir / scheme
    exported = export_folder(checkpoint, out)
    assert exported.architecture == NATIVE.get(scheme, CUSTOM_ARCHITECTURE), exported.reason
    model, tokenizer = load_checkpoint(checkpoint, device="cpu")
    config = json.loads((out / "config.json").read_text())
    assert ModelConfig.from_dict(config["ordinal_config"]) == model.config  # for an import
    assert (out / "modeling_ordinal.py").is_file() == (not exported.native)

    hf_model = load_hf(out)
    assert type(hf_model).__name__ == exported.architecture
    ids = prompt_ids(model, tokenizer)
    assert len(ids) == (128 if model.positional.is_table else PROMPT_TOKENS)
    assert largest_logit_difference(model, hf_model, ids) < 1e-4
    assert_generates_as_ordinal(model, hf_model, ids[: len(ids) - NEW_TOKENS])

    hf_tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert hf_tokenizer(TEXT)["input_ids"] == encode_prompt(tokenizer, TEXT)
    assert hf_tokenizer.decode(ids[1:]) == tokenizer.decode(ids[1:])
    scene = ChatTemplate.from_checkpoint(checkpoint).encode(
        tokenizer, [Message(m["role"], m["content"], m.get("name")) for m in MESSAGES]
    )
    rendered = hf_tokenizer.apply_chat_template(MESSAGES, return_dict=True)
    assert rendered["input_ids"] == scene.prompt_ids
    assert hf_tokenizer.decode(scene.prompt_ids).endswith(
        "<|eos|>ROMEO:\nSpeak again, bright angel!<|eos|>NURSE:\n"
    )


@pytest.mark.parametrize("scheme", SHIPPED_MODELS)
def test_the_custom_code_port_is_every_scheme_on_a_left_padded_batch(
    scheme: str, export_dir: Path
) -> None:
    checkpoint = SHIPPED / scheme
    out = export_dir / f"{scheme}-custom"
    assert export_folder(checkpoint, out, target="custom").architecture == CUSTOM_ARCHITECTURE
    model, tokenizer = load_checkpoint(checkpoint, device="cpu")
    hf_model = load_hf(out)
    ids = prompt_ids(model, tokenizer)
    assert largest_logit_difference(model, hf_model, ids) < 1e-4
    assert_left_padded_rows_decode_alone(model, hf_model, ids, tokenizer.token_to_id("<|pad|>"))


# Why --target native and --format gguf refuse each of TINY_CHECKPOINTS (and auto writes custom
# code): Nemotron's and GPT-2's reasons, and the GGUF export's.
TINY_REFUSALS = {
    "irope": (
        r"irope leaves layers \[2\] unrotated \(NoPE\); GPT-2 only adds a vector per position; "
        "irope acts inside attention",
        r"not exactly llama.cpp's nemotron: .* irope leaves layers \[2\] unrotated",
    ),
    "stickbreaking": (
        "this is stickbreaking; GPT-2 only adds a vector per position; stickbreaking acts inside "
        "attention",
        "scheme 'stickbreaking' has no GGUF architecture",
    ),
    "pope": (
        "this is pope; GPT-2 only adds a vector per position; pope acts inside attention",
        "scheme 'pope' has no GGUF architecture",
    ),
    "pathfox": (
        "this is pathfox; GPT-2 only adds a vector per position; pathfox acts inside attention",
        "scheme 'pathfox' has no GGUF architecture",
    ),
}


@pytest.mark.parametrize("scheme", TINY_CHECKPOINTS)
def test_a_scheme_without_a_shipped_checkpoint_exports_exactly(
    scheme: str, tiny_checkpoints: dict[str, Path], export_dir: Path
) -> None:
    """The checks a shipped checkpoint gets, past irope's window and temperature floor: logits
    over 120 tokens, 50 greedy tokens from ``generate()``, a left-padded batch row for row."""
    checkpoint, out = tiny_checkpoints[scheme], export_dir / f"{scheme}-tiny"
    native_why, gguf_why = TINY_REFUSALS[scheme]
    with pytest.raises(ExportError, match=native_why):
        export_folder(checkpoint, out, target="native")
    with pytest.raises(ExportError, match=gguf_why):
        export_gguf(checkpoint, export_dir / f"{scheme}.gguf")
    assert not out.exists() and not (export_dir / f"{scheme}.gguf").exists()

    exported = export_folder(checkpoint, out)  # auto: custom code, saying why
    assert exported.architecture == CUSTOM_ARCHITECTURE
    assert re.match(f"no native architecture is exact: .*{native_why}", exported.reason)
    model, tokenizer = load_checkpoint(checkpoint, device="cpu")
    assert model.config.dtype == "bfloat16"
    hf_model = load_hf(out)
    assert type(hf_model).__name__ == CUSTOM_ARCHITECTURE
    ids = torch.randint(3, 300, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    assert largest_logit_difference(model, hf_model, ids) < 1e-4
    assert_generates_as_ordinal(model, hf_model, ids[: len(ids) - NEW_TOKENS])
    assert_left_padded_rows_decode_alone(model, hf_model, ids, tokenizer.token_to_id("<|pad|>"))


# Tiny random checkpoints: (scheme, config changes, the architecture auto picks, why if custom).
VARIANTS: list[tuple[str, dict[str, Any], str, str | None]] = [
    ("rope", {"bias": True, "mlp": "gelu_tanh"}, "NemotronForCausalLM", None),
    ("rope", {"tie_embeddings": False, "mlp": "gelu"}, "NemotronForCausalLM", None),
    (
        "rope",
        {
            "positional": {
                "scheme": "rope",
                "rotary_fraction": 0.5,
                "base": 500.0,
                "scaling": "linear",
                "scaling_factor": 2.0,
            }
        },
        "NemotronForCausalLM",
        None,
    ),
    (
        "rope",
        {"positional": {"scheme": "rope", "scaling": "ntk", "scaling_factor": 4.0}},
        "NemotronForCausalLM",
        None,
    ),
    ("learned", {"bias": True, "mlp": "gelu", "tie_embeddings": False}, "GPT2LMHeadModel", None),
    (
        "rope",
        {"positional": {"scheme": "rope", "scaling": "yarn", "scaling_factor": 4.0}},
        CUSTOM_ARCHITECTURE,
        "yarn",
    ),
    (
        "rope",
        {"positional": {"scheme": "rope", "scaling": "dynamic", "scaling_factor": 2.0}},
        CUSTOM_ARCHITECTURE,
        "dynamic",
    ),
    ("rope", {"norm": "rmsnorm", "mlp": "swiglu"}, CUSTOM_ARCHITECTURE, "rmsnorm"),
    ("rope", {"qk_norm": True}, CUSTOM_ARCHITECTURE, "qk_norm"),
    ("learned", {"mlp": "swiglu"}, CUSTOM_ARCHITECTURE, "swiglu"),
    ("sinusoidal", {"bias": True}, CUSTOM_ARCHITECTURE, "formula"),
    (
        "rope",
        {
            "positional": {
                "scheme": "rope",
                "fraction": 0.5,
                "rotary_fraction": 0.5,
                "scaling": "yarn",
                "scaling_factor": 4.0,
            }
        },
        CUSTOM_ARCHITECTURE,
        "p-RoPE (fraction 0.5)",
    ),
    ("fox", {"bias": True, "mlp": "gelu"}, CUSTOM_ARCHITECTURE, "fox acts inside attention"),
    ("cope", {}, CUSTOM_ARCHITECTURE, "cope acts inside attention"),  # 16 rows: past the last
    ("fire", {"tie_embeddings": False}, CUSTOM_ARCHITECTURE, "fire acts inside attention"),
    (
        "fire",
        {"positional": {"scheme": "fire", "hidden": 8, "log_transform": False}},
        CUSTOM_ARCHITECTURE,
        None,
    ),
    ("fire", {"positional": {"scheme": "fire", "normalise": False}}, CUSTOM_ARCHITECTURE, None),
    # a rope layer with a window of 8, then a NoPE layer sharpened past position 16 (the tiny
    # config's); then irope's default schedule and temperature scale with rope's options
    ("irope", {}, CUSTOM_ARCHITECTURE, "irope leaves layers [1] unrotated (NoPE)"),
    (
        "irope",
        {
            "n_layers": 4,
            "qk_norm": True,
            "positional": {
                "scheme": "irope",
                "temperature_floor": 4,
                "base": 500.0,
                "scaling": "yarn",
                "scaling_factor": 2.0,
            },
        },
        CUSTOM_ARCHITECTURE,
        "irope leaves layers [3] unrotated (NoPE)",
    ),
    ("stickbreaking", {"mlp": "gelu"}, CUSTOM_ARCHITECTURE, "stickbreaking acts inside attention"),
    ("stickbreaking", {"norm": "rmsnorm", "mlp": "swiglu"}, CUSTOM_ARCHITECTURE, None),
    ("pope", {"bias": True, "mlp": "gelu"}, CUSTOM_ARCHITECTURE, "pope acts inside attention"),
    ("pope", {"norm": "rmsnorm", "mlp": "swiglu", "qk_norm": True}, CUSTOM_ARCHITECTURE, None),
    ("path", {"bias": True, "mlp": "gelu"}, CUSTOM_ARCHITECTURE, "path acts inside attention"),
    ("pathfox", {"norm": "rmsnorm", "mlp": "swiglu", "qk_norm": True}, CUSTOM_ARCHITECTURE, None),
]


@pytest.mark.parametrize(("scheme", "changes", "architecture", "reason"), VARIANTS)
def test_a_config_exports_to_the_architecture_that_is_exact(
    scheme: str,
    changes: dict[str, Any],
    architecture: str,
    reason: str | None,
    tiny_tokenizer: Tokenizer,
    tmp_path: Path,
) -> None:
    model = random_model(scheme, seed=3, **changes)
    save_checkpoint(tmp_path / "checkpoint", model, tiny_tokenizer, dtype="float32")
    exported = export_folder(tmp_path / "checkpoint", tmp_path / "hf")
    assert exported.architecture == architecture
    if reason is not None:
        assert reason in exported.reason
    hf_model = load_hf(tmp_path / "hf")
    limit = model.positional.max_positions or 2 * model.config.context_length  # past L too
    ids = torch.randint(3, 300, (limit,), generator=torch.Generator().manual_seed(1)).tolist()
    assert largest_logit_difference(model, hf_model, ids) < 1e-4
    prompt = ids[:20]
    generated = hf_model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)
    assert generated[0, 20:].tolist() == ordinal_greedy(model, prompt, 30)


# Parameters that only set a scheme's initial weights, which a trained model stores.
INITIALISATION_ONLY = {
    "fox": {"bias_init"},
    "t5": {"alibi_init"},
    "path": {"beta_bias_init"},
    "pathfox": {"beta_bias_init"},
}


def test_the_port_computes_every_shipped_scheme_with_all_its_parameters() -> None:
    from interop.remote.modeling_ordinal import SCHEMES as PORT_SCHEMES

    assert set(PORTED_SCHEMES) == set(PORT_SCHEMES) <= set(SCHEMES)
    configs = [json.loads((SHIPPED / name / "config.json").read_text()) for name in SHIPPED_MODELS]
    shipped = {config["positional"]["scheme"] for config in configs}
    assert shipped | set(TINY_CHECKPOINTS) <= set(PORTED_SCHEMES)
    for scheme in PORTED_SCHEMES:  # a parameter added to a scheme must be added to the port
        port = PORT_SCHEMES[scheme]  # with the port's classes it builds on (irope's: Rope's)
        source = "".join(
            inspect.getsource(cls) for cls in port.__mro__ if cls.__module__ == port.__module__
        )
        for field in dataclasses.fields(SCHEMES[scheme].Params):
            if field.name not in INITIALISATION_ONLY.get(scheme, set()):
                assert f'params.get("{field.name}"' in source, (scheme, field.name)


def test_the_port_blocks_path_as_ordinal_does() -> None:
    """The same blocks round the same way: the exported logits stay within 1e-4."""
    from interop.remote.modeling_ordinal import PATH_BLOCK
    from model.positional.path import BLOCK

    assert PATH_BLOCK == BLOCK


def test_a_scheme_the_port_lacks_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheme registered after the port was written (here: fox, as if it were)."""
    monkeypatch.setattr(
        "interop.hf_export.PORTED_SCHEMES", tuple(s for s in PORTED_SCHEMES if s != "fox")
    )
    model = random_model("fox")
    for target in TARGETS:  # neither a native architecture nor the port: never a wrong folder
        with pytest.raises(ExportError, match="scheme 'fox' has no Hugging Face export"):
            export_model(model, load_tokenizer(SHIPPED / "rope" / "tokenizer.json"), target)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("alibi", "alibi acts inside attention"),
        ("fire", "fire acts inside attention"),
        ("fox", "fox acts inside attention"),
        ("cope", "cope acts inside attention"),
        ("pope", "this is pope; GPT-2 only adds a vector per position; pope acts inside attention"),
        ("prope", r"p-RoPE \(fraction 0.75\) leaves its slowest pairs unturned"),
    ],
)
def test_native_refuses_what_no_native_architecture_computes(
    name: str, why: str, export_dir: Path
) -> None:
    with pytest.raises(ExportError, match=why):
        export_folder(SHIPPED / name, export_dir / "never", target="native")
    assert not (export_dir / "never").exists()


def test_the_command_line_writes_the_folder_whole_or_not_at_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rope"
    assert ordinal.main(["export", str(SHIPPED / "alibi"), str(out), "--target", "native"]) == 2
    assert "ordinal export: error: no native Hugging Face architecture" in capsys.readouterr().err
    assert not out.exists()  # a refused export writes nothing

    assert ordinal.main(["export", str(SHIPPED / "rope"), str(out)]) == 0
    assert "NemotronForCausalLM (native)" in capsys.readouterr().out
    first = tree_digest(tmp_path)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # An earlier export is replaced without --force: the same checkpoint, the same bytes.
    assert ordinal.main(["export", str(SHIPPED / "none"), str(out)]) == 0
    assert "GPT2LMHeadModel" in capsys.readouterr().out
    assert ordinal.main(["export", str(SHIPPED / "rope"), str(out)]) == 0
    assert tree_digest(tmp_path) == first  # swapped in whole: no staging left, nothing of none's


def test_the_command_line_knows_the_exports_choices_and_refuses_to_overwrite_its_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (ordinal.EXPORT_TARGETS, ordinal.EXPORT_FORMATS) == (TARGETS, FORMATS)
    checkpoint = tmp_path / "rope"
    save_checkpoint(checkpoint, *load_checkpoint(SHIPPED / "rope", device="cpu"))
    before = tree_digest(tmp_path)
    for extra in ([], ["--format", "gguf"], ["--force"]):
        assert ordinal.main(["export", str(checkpoint), str(checkpoint), *extra]) == 2
        assert "is what this command reads" in capsys.readouterr().err
    assert tree_digest(tmp_path) == before
    assert load_checkpoint(checkpoint, device="cpu")  # still a checkpoint


@pytest.fixture
def rope_copy(tmp_path: Path) -> Path:
    """A copy of the shipped rope checkpoint, with the eval.json and metrics.json it ships."""
    checkpoint = tmp_path / "ckpt" / "rope"
    shutil.copytree(SHIPPED / "rope", checkpoint)
    return checkpoint


def occupy(root: Path) -> dict[str, list[str]]:
    """Folders and files under ``root`` that an export must not replace, and the ``ordinal
    export`` arguments (after the checkpoint) that aim at each: name → arguments."""
    (root / "notes").mkdir()
    (root / "notes" / "plan.txt").write_text("a user's folder")
    (root / "draft.gguf").write_text("a user's file, not a GGUF")
    shutil.copytree(root / "ckpt" / "rope", root / "other")  # another checkpoint
    (root / "links").mkdir()
    (root / "links" / "out").symlink_to(root / "notes")
    gguf = ["--format", "gguf"]
    return {
        "a user's folder": [str(root / "notes")],
        "a user's file": [str(root / "draft.gguf"), *gguf],
        "the checkpoint's own weights": [str(root / "ckpt" / "rope" / "model.safetensors"), *gguf],
        "the checkpoint's folder": [str(root / "ckpt" / "rope")],
        "a folder inside the checkpoint": [str(root / "ckpt" / "rope" / "hf")],
        "the folder of checkpoints (every shipped model)": [str(root / "ckpt")],
        "another checkpoint": [str(root / "other")],
        "a file inside another checkpoint": [str(root / "other" / "rope.gguf"), *gguf],
        "a symlink to a user's folder": [str(root / "links" / "out")],
    }


FORCE_REPLACES = {"a user's folder", "a user's file"}  # what --force is for; never the rest


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_export_refuses_every_occupied_or_dangerous_out_and_changes_nothing(
    rope_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], force: bool
) -> None:
    """The issue's reports (``export ckpt/rope checkpoints`` deleted every shipped model, a
    GGUF written over ``ckpt/rope/model.safetensors``, user folders and files replaced without
    a word): each a one-line refusal, exit 2, the whole tree byte for byte as it was."""
    targets = occupy(tmp_path)
    before = tree_digest(tmp_path)
    for what, out in targets.items():
        if force and what in FORCE_REPLACES:
            continue
        argv = ["export", str(rope_copy), *out, *(["--force"] if force else [])]
        assert ordinal.main(argv) == 2, what
        error = capsys.readouterr().err
        assert error.startswith("ordinal export: error: OUT "), (what, error)
        assert error.count("\n") == 1 and "Traceback" not in error, what
        assert tree_digest(tmp_path) == before, what


def test_force_replaces_a_user_folder_or_file_whole_and_atomically(
    rope_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    occupy(tmp_path)
    notes, draft = tmp_path / "notes", tmp_path / "draft.gguf"
    # Killed while writing the new folder: the old one stays whole, nothing half-written beside.
    before = tree_digest(tmp_path)

    def interrupted(*args: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("interop.hf_export.hf_tokenizer", interrupted)
    assert ordinal.main(["export", str(rope_copy), str(notes), "--force"]) == 130
    assert tree_digest(tmp_path) == before
    monkeypatch.undo()

    assert ordinal.main(["export", str(rope_copy), str(notes), "--force"]) == 0
    assert {p.name for p in notes.iterdir()} == set(FOLDER_FILES) - set(REMOTE_FILES)  # native
    # nothing of the user's folder is left in the export
    assert load_hf(notes) is not None
    assert ordinal.main(["export", str(rope_copy), str(draft), "--format", "gguf", "--force"]) == 0
    assert gguf_field(gguf.GGUFReader(draft), "general.architecture") == "nemotron"
    after = tree_digest(tmp_path)
    assert not [name for name in after if name.split("/")[-1].startswith(".")]  # no staging
    # Earlier outputs of the same kind are written again without --force.
    assert ordinal.main(["export", str(rope_copy), str(notes)]) == 0
    assert ordinal.main(["export", str(rope_copy), str(draft), "--format", "gguf"]) == 0
    assert tree_digest(tmp_path) == after


def gguf_field(reader: gguf.GGUFReader, key: str) -> Any:
    return reader.fields[key].contents()


def test_gguf_holds_the_rope_model_and_its_tokenizer(export_dir: Path) -> None:
    path = export_dir / "rope.gguf"
    export_gguf(SHIPPED / "rope", path)
    model, tokenizer = load_checkpoint(SHIPPED / "rope", device="cpu")
    config = model.config
    reader = gguf.GGUFReader(path)
    expected = {
        "general.architecture": "nemotron",
        "nemotron.block_count": config.n_layers,
        "nemotron.embedding_length": config.d_model,
        "nemotron.feed_forward_length": config.d_ff,
        "nemotron.attention.head_count": config.n_heads,
        "nemotron.attention.head_count_kv": config.n_heads,
        "nemotron.rope.dimension_count": config.head_dim,
        "nemotron.rope.freq_base": 10000.0,
        "nemotron.vocab_size": config.vocab_size,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.bos_token_id": tokenizer.token_to_id("<|bos|>"),
        "tokenizer.ggml.eos_token_id": tokenizer.token_to_id("<|eos|>"),
        "tokenizer.ggml.padding_token_id": tokenizer.token_to_id("<|pad|>"),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
    }
    assert {key: gguf_field(reader, key) for key in expected} == expected
    assert gguf_field(reader, "nemotron.attention.layer_norm_epsilon") == pytest.approx(1e-5)
    vocabulary = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    assert gguf_field(reader, "tokenizer.ggml.tokens") == [token for token, _ in vocabulary]
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    assert gguf_field(reader, "tokenizer.ggml.merges") == [" ".join(m) for m in merges]
    types = gguf_field(reader, "tokenizer.ggml.token_type")
    assert types[:3] == [gguf.TokenType.CONTROL] * 3 and set(types[3:]) == {gguf.TokenType.NORMAL}
    assert gguf_field(reader, "tokenizer.chat_template").startswith("{%- set speakers")

    state = {name: tensor.float().numpy() for name, tensor in model.state_dict().items()}
    d = config.d_model
    wanted = {
        "token_embd.weight": state["token_embedding.weight"],
        "output.weight": state["token_embedding.weight"],
        "output_norm.weight": state["final_norm.weight"],
        "output_norm.bias": np.zeros(d, np.float32),
    }
    for i in range(config.n_layers):
        qkv = state[f"blocks.{i}.attention.qkv.weight"]
        wanted |= {
            f"blk.{i}.attn_norm.weight": state[f"blocks.{i}.attention_norm.weight"],
            f"blk.{i}.attn_norm.bias": np.zeros(d, np.float32),
            f"blk.{i}.attn_q.weight": qkv[:d],
            f"blk.{i}.attn_k.weight": qkv[d : 2 * d],
            f"blk.{i}.attn_v.weight": qkv[2 * d :],
            f"blk.{i}.attn_output.weight": state[f"blocks.{i}.attention.proj.weight"],
            f"blk.{i}.ffn_norm.weight": state[f"blocks.{i}.mlp_norm.weight"],
            f"blk.{i}.ffn_norm.bias": np.zeros(d, np.float32),
            f"blk.{i}.ffn_up.weight": state[f"blocks.{i}.mlp.up.weight"],
            f"blk.{i}.ffn_down.weight": state[f"blocks.{i}.mlp.down.weight"],
        }
    stored = {tensor.name: tensor for tensor in reader.tensors}
    assert sorted(stored) == sorted(wanted)
    for name, array in wanted.items():
        assert stored[name].tensor_type == gguf.GGMLQuantizationType.F32, name
        np.testing.assert_array_equal(np.asarray(stored[name].data), array, err_msg=name)


def test_gguf_pads_a_vocabulary_shorter_than_the_embedding(
    tiny_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    model = random_model("rope", seed=1)  # 320 embedding rows, 300 tokens
    save_checkpoint(tmp_path / "rope", model, tiny_tokenizer, dtype="float32")
    export_gguf(tmp_path / "rope", tmp_path / "rope.gguf")
    reader = gguf.GGUFReader(tmp_path / "rope.gguf")
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    types = gguf_field(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == model.config.vocab_size
    assert tokens[300:] == [f"[PAD{i}]" for i in range(300, 320)]
    assert set(types[300:]) == {gguf.TokenType.UNUSED}


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("alibi", "'alibi' has no GGUF architecture"),
        ("pope", "'pope' has no GGUF architecture"),
        ("prope", r"not exactly llama.cpp's nemotron: p-RoPE \(fraction 0.75\)"),
    ],
)
def test_gguf_refuses_what_llama_cpp_has_no_architecture_for(
    name: str, why: str, export_dir: Path
) -> None:
    with pytest.raises(ExportError, match=why):
        export_gguf(SHIPPED / name, export_dir / f"{name}.gguf")
    assert not (export_dir / f"{name}.gguf").exists()
