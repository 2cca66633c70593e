"""``ordinal import`` against tiny models built here with ``transformers`` (random weights,
``save_pretrained``, a byte-level BPE tokenizer trained here; nothing from the hub): GPT-2,
Llama with grouped-query attention, and Llama with an untied output matrix. After the import,
ordinal's logits equal transformers' on a ragged batch, cached decoding equals the full
forward, the imported model serves over HTTP, and what the core cannot represent is refused
with a message naming it."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

import interop.hf_import
import ordinal
from model.cache import KVCache
from model.checkpoint import load_checkpoint
from model.tokenizer import special_ids
from model.transformer import Transformer
from tests.model.conftest import tree_digest
from tests.server.conftest import running_server, sse_events, test_settings

transformers = pytest.importorskip("transformers")
from tests.interop.hf_models import gpt2, llama  # noqa: E402 (needs transformers)

REPO = Path(__file__).resolve().parents[2]
LENGTHS = (11, 4, 8)  # a ragged batch: rows of different lengths, right-padded
TOLERANCE = 1e-4  # float32

torch.set_num_threads(1)


FAMILIES: dict[str, Callable[[Path], Path]] = {
    "gpt2": gpt2,
    "llama-gqa": lambda folder: llama(folder, tie=True),
    "llama-untied": lambda folder: llama(folder, tie=False),
}


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each family: (its Hugging Face folder, the checkpoint ``ordinal import`` made of it)."""
    root = tmp_path_factory.mktemp("import")
    folders = {}
    for name, build in FAMILIES.items():
        source, out = build(root / "hf" / name), root / "ordinal" / name
        assert ordinal.main(["import", str(source), str(out)]) == 0
        folders[name] = (source, out)
    return folders


def ragged_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [3, 11] (random ids, rows padded on the right with id 0) and the rows' lengths."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, vocab, (len(LENGTHS), max(LENGTHS)), generator=generator)
    lengths = torch.tensor(LENGTHS)
    tokens[torch.arange(tokens.shape[1]) >= lengths.unsqueeze(1)] = 0
    return tokens, lengths


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_on_a_ragged_batch(
    imported: dict[str, tuple[Path, Path]], family: str
) -> None:
    source, out = imported[family]
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model, _ = load_checkpoint(out, device="cpu")
    tokens, lengths = ragged_batch(model.config.vocab_size)
    real = torch.arange(tokens.shape[1]) < lengths.unsqueeze(1)  # [B, T]
    with torch.no_grad():
        expected = reference.eval()(input_ids=tokens, attention_mask=real.long()).logits
        full = model(tokens)  # right padding: no real token sees a padded one
        cache = KVCache(model.config, len(LENGTHS), 16)
        cached = model(tokens, cache, new_counts=lengths)  # the ragged prefill of a cache
    assert expected[real].abs().max() > 1  # logits that differ visibly between tokens
    torch.testing.assert_close(full[real], expected[real], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(cached[real], expected[real], atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decoding_equals_the_full_forward(
    imported: dict[str, tuple[Path, Path]], family: str
) -> None:
    model, _ = load_checkpoint(imported[family][1], device="cpu")
    tokens, lengths = ragged_batch(model.config.vocab_size)
    continuation = torch.randint(3, model.config.vocab_size, (len(LENGTHS), 5))
    cache = KVCache(model.config, len(LENGTHS), 32)
    with torch.no_grad():
        model(tokens, cache, new_counts=lengths)
        steps = [model(continuation[:, [i]], cache, last_only=True) for i in range(5)]
        for row, length in enumerate(LENGTHS):
            whole = torch.cat([tokens[row, :length], continuation[row]]).unsqueeze(0)
            expected = model(whole)[0, length:]
            decoded = torch.stack([step[row] for step in steps])
            torch.testing.assert_close(decoded, expected, atol=1e-5, rtol=0)
    # grouped-query attention caches only the key/value heads
    assert cache.keys.shape[2] == model.config.key_value_heads


def test_the_core_holds_what_each_family_needs(imported: dict[str, tuple[Path, Path]]) -> None:
    gpt, gqa, untied = (load_checkpoint(imported[name][1], device="cpu") for name in FAMILIES)
    assert gpt.model.config.scheme == "learned" and gpt.model.config.bias
    assert gpt.model.config.mlp == "gelu_tanh"
    assert gqa.model.config.scheme == "rope" and gqa.model.config.positional["base"] == 500.0
    assert (gqa.model.config.n_heads, gqa.model.config.key_value_heads) == (4, 2)
    assert gqa.model.lm_head.weight is gqa.model.token_embedding.weight
    assert not untied.model.config.tie_embeddings
    assert not torch.equal(untied.model.lm_head.weight, untied.model.token_embedding.weight)
    # GPT-2's one <|endoftext|> begins and ends; Llama's <s> and </s>; no bos added twice.
    gpt_ids, llama_ids = special_ids(gpt.tokenizer), special_ids(gqa.tokenizer)
    assert gpt_ids.bos == gpt_ids.eos == gpt.tokenizer.token_to_id("<|endoftext|>")
    assert (llama_ids.bos, llama_ids.eos) == tuple(map(gqa.tokenizer.token_to_id, ["<s>", "</s>"]))
    assert gqa.tokenizer.token_to_id("<s>") not in gqa.tokenizer.encode("To be").ids


def test_an_untied_checkpoint_saves_and_loads_its_own_output(
    imported: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    from model.checkpoint import save_checkpoint

    model, tokenizer = load_checkpoint(imported["llama-untied"][1], device="cpu")
    save_checkpoint(tmp_path / "again", model, tokenizer)
    again, _ = load_checkpoint(tmp_path / "again", device="cpu")
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


def test_imported_models_serve_stream_and_trace(
    imported: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    for name, (_, out) in imported.items():
        shutil.copytree(out, tmp_path / name)
    with (
        running_server(test_settings(tmp_path, max_batch_size=4)) as running,
        httpx.Client(base_url=running.url, timeout=60) as client,
    ):
        for name in FAMILIES:
            body = {"model": name, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            batch = client.post("/v1/completions", json={**body, "prompt": ["To be", "Now is"]})
            assert batch.status_code == 200, batch.text
            assert [choice["index"] for choice in batch.json()["choices"]] == [0, 1]
            assert batch.json()["usage"]["completion_tokens"] == 12
            with client.stream(
                "POST", "/v1/completions", json={**body, "prompt": "To be", "stream": True}
            ) as stream:
                events = list(sse_events(stream.iter_lines()))
            assert events[-1] == "[DONE]"
            streamed = "".join(event["choices"][0]["text"] for event in events[:-1])  # type: ignore[index]
            assert streamed == batch.json()["choices"][0]["text"]
            chat = {"model": name, "messages": [{"role": "user", "content": "To be?"}]}
            answer = client.post("/v1/chat/completions", json={**chat, "max_tokens": 4})
            assert answer.status_code == 200, answer.text
            trace = client.post("/v1/trace", json={"model": name, "prompt": "To be, or not"})
            assert trace.status_code == 200, trace.text
            assert len(trace.json()["attention"]) == 2  # one entry per layer


def test_greedy_tokens_match_transformers_generate(
    imported: dict[str, tuple[Path, Path]],
) -> None:
    source, out = imported["llama-gqa"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model, _ = load_checkpoint(out, device="cpu")
    prompt = torch.tensor([[5, 17, 42, 99]])
    with torch.no_grad():
        expected = reference.eval().generate(
            prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, 4:]
    assert greedy(model, prompt, 12) == expected.tolist()


def greedy(model: Transformer, prompt: torch.Tensor, steps: int) -> list[int]:
    cache = KVCache(model.config, 1, prompt.shape[1] + steps)
    with torch.no_grad():
        logits = model(prompt, cache, last_only=True)
        tokens = []
        for _ in range(steps):
            tokens.append(int(logits.argmax(-1)))
            logits = model(torch.tensor([[tokens[-1]]]), cache, last_only=True)
    return tokens


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    ("family", "change", "named"),
    [
        ("llama-gqa", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters"),
        ("llama-gqa", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ("llama-gqa", {"sliding_window": 16}, "sliding_window"),
        ("llama-gqa", {"attention_bias": True}, "attention_bias"),
        ("llama-gqa", {"hidden_act": "gelu"}, "hidden_act"),
        ("gpt2", {"activation_function": "relu"}, "activation_function"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ("gpt2", {"architectures": ["MistralForCausalLM"]}, "MistralForCausalLM"),
    ],
)
def test_what_the_core_cannot_represent_is_refused_by_name(
    imported: dict[str, tuple[Path, Path]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    family: str,
    change: dict[str, Any],
    named: str,
) -> None:
    source = tmp_path / "hf"
    shutil.copytree(imported[family][0], source)
    edit_config(source, **change)
    assert ordinal.main(["import", str(source), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("ordinal import: error: ") and named in error
    assert "Traceback" not in error
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_tensor_the_core_has_no_place_for_is_refused(
    imported: dict[str, tuple[Path, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file, save_file

    source = tmp_path / "hf"
    shutil.copytree(imported["llama-gqa"][0], source)
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    save_file(tensors, source / "model.safetensors")
    assert ordinal.main(["import", str(source), str(tmp_path / "out")]) == 2
    assert "layers.0.self_attn.q_proj.bias" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("family", "change", "named"),
    [
        (
            "llama-gqa",
            {"hidden_size": 2**26, "head_dim": 2**24},
            "'token_embedding.weight' has shape (320, 32)",
        ),
        ("llama-gqa", {"intermediate_size": 2**30}, "'blocks.0.mlp.up.weight' has shape"),
        ("gpt2", {"n_embd": 2**26}, "'token_embedding.weight' has shape (320, 32)"),
        ("llama-untied", {"vocab_size": 2**31}, "'token_embedding.weight' has shape (320, 32)"),
    ],
)
def test_a_config_claiming_huge_sizes_is_refused_before_any_model_is_built(
    imported: dict[str, tuple[Path, Path]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    family: str,
    change: dict[str, Any],
    named: str,
) -> None:
    """The tiny weights under a config.json claiming a model of 80 GB or more: its model was
    built before any shape was compared (the allocator's traceback); now the headers' shapes
    are compared first, and the refusal is one line, in well under a second of work."""
    source = tmp_path / "hf"
    shutil.copytree(imported[family][0], source)
    edit_config(source, **change)
    started = time.monotonic()
    assert ordinal.main(["import", str(source), str(tmp_path / "out")]) == 2
    assert time.monotonic() - started < 5
    error = capsys.readouterr().err
    assert error.startswith("ordinal import: error: ") and error.count("\n") == 1
    assert named in error and "the config implies" in error and "Traceback" not in error
    assert not (tmp_path / "out").exists()


def test_a_model_larger_than_memory_is_refused_before_its_weights_are_read(
    imported: dict[str, tuple[Path, Path]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Shapes that match, memory that does not: the weights read and the model take 2 × 4
    bytes a parameter, more than the 1 KB said to be left (the cgroup's, here)."""
    monkeypatch.setattr(interop.hf_import, "available_memory", lambda: 2**10)
    monkeypatch.setattr(interop.hf_import, "read_safetensors", None)  # never called
    out = tmp_path / "out"
    assert ordinal.main(["import", str(imported["llama-gqa"][0]), str(out)]) == 2
    error = capsys.readouterr().err
    assert "GiB of memory is available" in error and error.count("\n") == 1
    assert not out.exists()


def test_a_missing_folder_is_an_error_not_a_download(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert ordinal.main(["import", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_imported_models_enter_the_geometry_report(
    imported: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    folders = [str(imported[name][1]) for name in ("gpt2", "llama-gqa")]
    assert ordinal.main(["geometry", "--checkpoints", *folders, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    measured = {entry["scheme"]: entry for entry in report["schemes"]}
    assert set(measured) == {"learned", "rope"}  # GPT-2's table of positions, Llama's rotation
    assert all("error" not in entry for entry in measured.values())


def test_without_named_specials_the_config_ids_name_them(
    imported: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """The hub's GPT-2 names no bos or eos in tokenizer_config.json: config.json's ids do."""
    source = tmp_path / "hf"
    shutil.copytree(imported["gpt2"][0], source)
    (source / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    assert ordinal.main(["import", str(source), str(tmp_path / "out")]) == 0
    tokenizer = load_checkpoint(tmp_path / "out", device="cpu").tokenizer
    ids = special_ids(tokenizer)
    assert ids.bos == ids.eos == ids.pad == tokenizer.token_to_id("<|endoftext|>") == 0


# ----------------------------------------------------------------------------------------------
# Where an import writes, and what it reads


def import_refused(argv: list[str], root: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``ordinal import ARGV``: refused with one line on stderr, exit 2, and the whole
    tree under ``root`` byte for byte as before. Returns the message."""
    before = tree_digest(root)
    assert ordinal.main(["import", *argv]) == 2, argv
    error = capsys.readouterr().err
    assert error.startswith("ordinal import: error: "), error
    assert error.count("\n") == 1 and "Traceback" not in error, error
    assert tree_digest(root) == before, argv
    return error


def test_import_refuses_occupied_or_dangerous_outs(
    imported: dict[str, tuple[Path, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``import hf hf`` replaced the source folder itself; a user's folder, an export and a
    folder of checkpoints were replaced without a word."""
    source = tmp_path / "hf"
    shutil.copytree(imported["gpt2"][0], source)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "plan.txt").write_text("a user's folder")
    exported = tmp_path / "exported" / "hf"
    assert ordinal.main(["export", str(REPO / "checkpoints" / "rope"), str(exported)]) == 0
    shutil.copytree(imported["llama-gqa"][1], tmp_path / "checkpoints" / "llama")
    capsys.readouterr()
    for out, force_too in [
        (source, True),  # the source itself
        (source / "ck", True),  # inside the source
        (tmp_path, True),  # the folder holding the source
        (tmp_path / "checkpoints", True),  # a folder of checkpoints
        (tmp_path / "checkpoints" / "llama" / "ck", True),  # inside a checkpoint
        (tmp_path / "notes", False),  # a user's folder
        (exported, False),  # an export, not a checkpoint
    ]:
        for force in [[], ["--force"]] if force_too else [[]]:
            import_refused([str(source), str(out), *force], tmp_path, capsys)

    assert ordinal.main(["import", str(source), str(tmp_path / "notes"), "--force"]) == 0
    assert not (tmp_path / "notes" / "plan.txt").exists()  # replaced whole, nothing carried
    assert load_checkpoint(tmp_path / "notes", device="cpu").model.config.scheme == "learned"


def test_import_over_a_checkpoint_keeps_neither_its_scores_nor_its_metrics(
    imported: dict[str, tuple[Path, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The new model was shown with the old one's eval.json and metrics.json."""
    out = tmp_path / "ck"
    shutil.copytree(REPO / "checkpoints" / "rope", out)
    assert {"eval.json", "metrics.json"} <= {p.name for p in out.iterdir()}
    (out / "notes.md").write_text("a user's notes on this folder")
    assert ordinal.main(["import", str(imported["gpt2"][0]), str(out)]) == 0
    assert "replaced the checkpoint" in capsys.readouterr().out
    assert not (out / "eval.json").exists() and not (out / "metrics.json").exists()
    assert (out / "notes.md").is_file()  # a user's own file beside a checkpoint is kept
    assert load_checkpoint(out, device="cpu").model.config.scheme == "learned"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


def escape(source: Path, outside: Path, name: str) -> None:
    """Move ``source/name`` out of the folder, to ``outside``, and link it back in."""
    shutil.move(source / name, outside)
    (source / name).symlink_to(outside)


def write_index(source: Path, shard: str) -> None:
    """Replace the weights by an index that names ``shard`` for every tensor."""
    from safetensors import safe_open

    with safe_open(source / "model.safetensors", framework="pt") as weights:
        names = list(weights.keys())
    (source / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys(names, shard)})
    )


ESCAPES: dict[str, Callable[[Path, Path], None]] = {
    # a private file published as the checkpoint's chat template
    "chat_template.jinja": lambda source, outside: (
        (outside / "secret.txt").write_text("{{ 'a private file' }}"),
        (source / "chat_template.jinja").symlink_to(outside / "secret.txt"),
    ),
    "model.safetensors": lambda source, outside: escape(
        source, outside / "w.safetensors", "model.safetensors"
    ),
    "tokenizer.json": lambda source, outside: escape(source, outside / "t.json", "tokenizer.json"),
    "tokenizer_config.json": lambda source, outside: escape(
        source, outside / "tc.json", "tokenizer_config.json"
    ),
    "config.json": lambda source, outside: escape(source, outside / "c.json", "config.json"),
    "../../x": lambda source, outside: (
        shutil.copy(source / "model.safetensors", outside / "x"),
        write_index(source, "../../x"),
    ),
    "absolute": lambda source, outside: (
        shutil.copy(source / "model.safetensors", outside / "x"),
        write_index(source, str(outside / "x")),
    ),
}


@pytest.mark.parametrize("attack", ESCAPES)
def test_import_reads_nothing_outside_the_folder(
    imported: dict[str, tuple[Path, Path]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    attack: str,
) -> None:
    """A cloned repository keeps its symlinks, and an index may name any path: each would put
    a local file into a published checkpoint. Refused, naming the file, nothing written."""
    outside = tmp_path / "repo"  # beside the model folder: ../../x from its files
    source = outside / "models" / "hf"
    shutil.copytree(imported["gpt2"][0], source)
    ESCAPES[attack](source, outside)
    error = import_refused([str(source), str(tmp_path / "out")], tmp_path, capsys)
    assert "outside" in error or "absolute path" in error
    assert not (tmp_path / "out").exists()


def test_links_and_shards_inside_the_folder_still_import(
    imported: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    """The check follows where a path leads, not whether it is a link: inside, it imports."""
    source = tmp_path / "hf"
    shutil.copytree(imported["gpt2"][0], source)
    (source / "shards").mkdir()
    shutil.move(source / "model.safetensors", source / "shards" / "all.safetensors")
    (source / "model.safetensors").symlink_to(Path("shards") / "all.safetensors")
    (source / "tokenizer.json").rename(source / "tok.json")
    (source / "tokenizer.json").symlink_to(source / "tok.json")  # absolute, yet inside
    write_index(source, "shards/../shards/all.safetensors")
    assert ordinal.main(["import", str(source), str(tmp_path / "out")]) == 0
    ours = load_checkpoint(tmp_path / "out", device="cpu").model
    theirs = load_checkpoint(imported["gpt2"][1], device="cpu").model
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
