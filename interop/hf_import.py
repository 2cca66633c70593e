"""``ordinal import``: a Hugging Face model folder → an ordinal checkpoint folder.

Two families map exactly onto the model core (``model.transformer``), as config data:

- ``GPT2LMHeadModel``: LayerNorm with biases, biases on every projection, tanh GELU (or exact
  GELU), the learned table of ``n_positions`` positions (the ``learned`` scheme), tied or untied
  output. GPT-2's ``Conv1D`` stores its weights [in, out]; the core's linears are [out, in].
- ``LlamaForCausalLM`` (SmolLM, TinyLlama, ...): RMSNorm, SwiGLU, rope with base ``rope_theta``
  (Hugging Face's ``rotate_half`` is the core's half-split layout), grouped-query attention,
  tied or untied output. q, k and v (and gate and up) are stacked into the core's fused matrices.

Anything the core cannot compute exactly is an :class:`UnsupportedModel` naming it, before
anything is written: another architecture, rope scaling, a sliding window, biases on a Llama, an
activation the family does not use, a tensor the core has no place for. Weights are read with
``safetensors`` (transformers is not needed). The tokenizer is the folder's ``tokenizer.json``
(byte-level BPE, as ordinal decodes); its bos and eos tokens, from ``tokenizer_config.json`` (or
config.json's ids), are recorded in the checkpoint's own tokenizer_config.json, where
``model.tokenizer.load_tokenizer`` finds them. Its post-processor is replaced by ordinal's: the
bos token first. A hub name ("owner/model") is downloaded only when no such folder exists and
``huggingface_hub`` can reach the hub. Every file read must lie inside the folder once its
symlinks are followed (:class:`SourceFolder`): a symlink or an index entry leading out of it is
refused, never read. The checkpoint is written where ``model.files.check_output`` allows: never
over the folder read, over something other than a checkpoint only with ``--force``.

A folder ``ordinal export`` wrote (config.json holds ``ordinal_config``) imports back as the
checkpoint it came from: that config, and every tensor equal bit for bit (:func:`import_export`).
Its weights are mapped back (the custom code's are ordinal's own; Nemotron's norms get their 1
back and q, k, v are fused again; GPT-2's Conv1D weights are transposed back, the zero biases and
none's zero table dropped), and then the model is exported again: the import stands only if that
gives the folder's config.json and every one of its tensors exactly, so a folder edited since, or
one whose mapping lost something, is refused rather than imported as another model. A GPT-2
export of mds or lowrank is such a loss (their parameters were baked into the position table) and
is refused, naming the custom-code export that round-trips.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch import Tensor

from interop.hf_export import (
    CUSTOM_ARCHITECTURE,
    EXPORTED_CONFIG,
    checkpoint_chat_template,
    export_model,
    float32_copies,
    native_for,
)
from model.chat import DEFAULT_TEMPLATE, default_tokenizer_config
from model.checkpoint import TOKENIZER_FILE, expected_shapes, save_checkpoint
from model.config import ModelConfig
from model.device import DTYPES, resolve_dtype
from model.files import CHECKPOINT, WEIGHTS_RECORDS, check_output, not_a_checkpoint
from model.memory import available_memory, where_memory_ends
from model.positional import build_scheme
from model.tokenizer import (
    TokenizerError,
    check_tokenizer_size,
    name_special_tokens,
    special_ids,
    special_token_config,
    special_token_names,
    token_bytes,
)
from model.transformer import Transformer

HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded checkpoint's map of tensors
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_CHAT_TEMPLATE = "chat_template.jinja"  # newer transformers save the template beside it
# What a hub download fetches: nothing but what the import reads.
HUB_FILES = ["*.json", "*.safetensors", HF_CHAT_TEMPLATE]


class UnsupportedModel(ValueError):
    """A Hugging Face folder the model core cannot represent exactly (or cannot read)."""


@dataclass(frozen=True)
class Family:
    """How one architecture maps: its config.json → ModelConfig, and its tensors → the core's."""

    config: Callable[[dict[str, Any]], ModelConfig]
    weights: Callable[[_Tensors, ModelConfig], dict[str, Tensor]]


def import_model(
    source: str | Path, out: Path, dtype: str | None = None, *, force: bool = False
) -> ModelConfig:
    """Convert the Hugging Face model at ``source`` (a folder, or a hub name) into the
    checkpoint folder ``out`` (written atomically where ``model.files.check_output`` allows,
    ``force`` over a folder that is no checkpoint), its weights stored in ``dtype`` (default:
    the folder's; an export's: its checkpoint's); returns its config."""
    folder = resolve_folder(str(source))
    check_output(out, CHECKPOINT, sources=[folder.path], force=force)
    hf_config = _read_json(folder.file(HF_CONFIG_FILE))
    if EXPORTED_CONFIG in hf_config:
        return import_export(folder, hf_config, out, dtype)
    architecture = _architecture(hf_config)
    family = FAMILIES[architecture]
    config = family.config(hf_config)
    if dtype is not None:
        config = config.replace(dtype=dtype)
    # The mapping first runs on the headers' shapes alone (meta tensors): a config claiming
    # huge sizes is refused here, before any weight is read or any model built.
    shapes = _Tensors(read_safetensors_shapes(folder))
    check_shapes(family.weights(shapes, config), config)
    shapes.check_all_taken(architecture)
    tensors = _Tensors(read_safetensors(folder))
    state = family.weights(tensors, config)
    tensors.check_all_taken(architecture)
    tokenizer, tokenizer_config = read_tokenizer(folder, hf_config, config.vocab_size)
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise UnsupportedModel(
            f"{folder.path / TOKENIZER_FILE} has {tokenizer.get_vocab_size()} tokens but the "
            f"model's "
            f"vocab_size is {config.vocab_size}"
        )
    model = Transformer(config)
    _load_exactly(model, state)
    save_checkpoint(out, model, tokenizer, tokenizer_config=tokenizer_config)
    return config


def run(args: argparse.Namespace) -> None:
    """``ordinal import SOURCE OUT [--dtype DTYPE] [--force]``."""
    replaced = not_a_checkpoint(args.out) is None
    config = import_model(args.source, args.out, args.dtype, force=args.force)
    print(
        f"imported {args.source} → {args.out}: {config.scheme}, {config.n_layers} layers, "
        f"d_model {config.d_model}, {config.n_heads} heads ({config.key_value_heads} key/value)"
    )
    if replaced:  # said, not silent: the old model's scores went with it
        dropped = " and ".join(WEIGHTS_RECORDS)
        print(f"note: this replaced the checkpoint at {args.out} (without its {dropped})")


# ----------------------------------------------------------------------------------------------
# The families


def gpt2_config(hf: dict[str, Any]) -> ModelConfig:
    activation = hf.get("activation_function", "gelu_new")
    mlps = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    if activation not in mlps:
        raise UnsupportedModel(
            f"activation_function={activation!r}: the core's GPT-2 MLPs are {sorted(mlps)}"
        )
    _require(hf, "scale_attn_weights", True, "attention scores are always scaled by 1/√head_dim")
    _require(hf, "scale_attn_by_inverse_layer_idx", False, "no per-layer score scaling")
    _require(hf, "add_cross_attention", False, "a decoder-only model has no cross-attention")
    width, positions = hf["n_embd"], hf["n_positions"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=width,
        n_layers=hf["n_layer"],
        n_heads=hf["n_head"],
        d_ff=hf.get("n_inner") or 4 * width,
        context_length=positions,
        max_positions=positions,
        norm="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        mlp=mlps[activation],
        bias=True,
        tie_embeddings=hf.get("tie_word_embeddings", True),
        positional={"scheme": "learned"},
        dtype=_storage_dtype(hf),
    )


# GPT-2's per-block modules → the core's. Conv1D weights are [in, out]; norms are not Conv1D.
_GPT2_BLOCK = {
    "ln_1": "attention_norm",
    "attn.c_attn": "attention.qkv",
    "attn.c_proj": "attention.proj",
    "ln_2": "mlp_norm",
    "mlp.c_fc": "mlp.up",
    "mlp.c_proj": "mlp.down",
}


def gpt2_weights(tensors: _Tensors, config: ModelConfig) -> dict[str, Tensor]:
    tensors.strip_prefix("transformer.")
    # Older files also hold each block's causal mask as a buffer: no weight, nothing to map.
    tensors.discard(lambda name: name.endswith((".attn.bias", ".attn.masked_bias")))
    state = {
        "token_embedding.weight": tensors.take("wte.weight"),
        "positional.table": tensors.take("wpe.weight"),
        "final_norm.weight": tensors.take("ln_f.weight"),
        "final_norm.bias": tensors.take("ln_f.bias"),
    }
    for layer in range(config.n_layers):
        for theirs, ours in _GPT2_BLOCK.items():
            weight = tensors.take(f"h.{layer}.{theirs}.weight")
            conv1d = not theirs.startswith("ln_")
            state[f"blocks.{layer}.{ours}.weight"] = weight.t() if conv1d else weight
            state[f"blocks.{layer}.{ours}.bias"] = tensors.take(f"h.{layer}.{theirs}.bias")
    _add_output(state, tensors, config)
    return state


def llama_config(hf: dict[str, Any]) -> ModelConfig:
    _require(hf, "hidden_act", "silu", "the core's gated MLP is SwiGLU")
    _require(hf, "attention_bias", False, "the core's Llama has no biases")
    _require(hf, "mlp_bias", False, "the core's Llama has no biases")
    _require(hf, "sliding_window", None, "the core attends to the whole context")
    _require(hf, "use_sliding_window", False, "the core attends to the whole context")
    rope = hf.get("rope_parameters") or {}
    for key in ("rope_parameters", "rope_scaling"):
        scaling = hf.get(key) or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind != "default":
            raise UnsupportedModel(
                f"{key} of type {kind!r}: only unscaled rope imports (extend the context at "
                f"serve time instead, e.g. rope+yarn4)"
            )
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModel("partial_rotary_factor: the core's Llama rotates whole heads")
    width, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or width // heads
    if head_dim * heads != width:
        raise UnsupportedModel(
            f"head_dim={head_dim}: the core's heads split hidden_size ({width}) into "
            f"num_attention_heads ({heads}) equal parts"
        )
    context = hf.get("max_position_embeddings", 2048)
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=width,
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        d_ff=hf["intermediate_size"],
        context_length=context,
        max_positions=context,
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        mlp="swiglu",
        bias=False,
        tie_embeddings=hf.get("tie_word_embeddings", False),
        positional={
            "scheme": "rope",
            "base": float(rope.get("rope_theta", hf.get("rope_theta", 1e4))),
        },
        dtype=_storage_dtype(hf),
    )


def llama_weights(tensors: _Tensors, config: ModelConfig) -> dict[str, Tensor]:
    tensors.strip_prefix("model.")
    state = {
        "token_embedding.weight": tensors.take("embed_tokens.weight"),
        "final_norm.weight": tensors.take("norm.weight"),
    }
    for layer in range(config.n_layers):
        theirs, ours = f"layers.{layer}.", f"blocks.{layer}."

        def stacked(*names: str) -> Tensor:
            return torch.cat([tensors.take(f"{theirs}{name}.weight") for name in names])  # noqa: B023

        state |= {
            f"{ours}attention_norm.weight": tensors.take(f"{theirs}input_layernorm.weight"),
            f"{ours}attention.qkv.weight": stacked(
                "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"
            ),
            f"{ours}attention.proj.weight": tensors.take(f"{theirs}self_attn.o_proj.weight"),
            f"{ours}mlp_norm.weight": tensors.take(f"{theirs}post_attention_layernorm.weight"),
            # The core's SwiGLU splits its fused projection into the gate, then the value.
            f"{ours}mlp.up.weight": stacked("mlp.gate_proj", "mlp.up_proj"),
            f"{ours}mlp.down.weight": tensors.take(f"{theirs}mlp.down_proj.weight"),
        }
    _add_output(state, tensors, config)
    return state


FAMILIES: dict[str, Family] = {
    "GPT2LMHeadModel": Family(gpt2_config, gpt2_weights),
    "LlamaForCausalLM": Family(llama_config, llama_weights),
}


def _add_output(state: dict[str, Tensor], tensors: _Tensors, config: ModelConfig) -> None:
    """The output matrix: its own when untied; tied, the embedding (a stored copy is dropped,
    as transformers ties it over whatever the file holds)."""
    if config.tie_embeddings:
        tensors.discard(lambda name: name == "lm_head.weight")
        state["lm_head.weight"] = state["token_embedding.weight"]
    else:
        state["lm_head.weight"] = tensors.take("lm_head.weight")


# ----------------------------------------------------------------------------------------------
# ordinal's own exports, imported back

# config.json keys that transformers adds on a save and that change nothing the model computes.
SAVE_METADATA = ("transformers_version", "_name_or_path")


def import_export(
    folder: SourceFolder, hf_config: dict[str, Any], out: Path, dtype: str | None
) -> ModelConfig:
    """The checkpoint ``ordinal export`` wrote ``folder`` from, at ``out``: its config (stored
    in ``dtype``, default its own) and every tensor exactly, or an UnsupportedModel saying why
    the folder is not exactly an export of it."""
    architecture = (hf_config.get("architectures") or [None])[0]
    inverses = {CUSTOM_ARCHITECTURE: ordinal_weights, **EXPORT_INVERSES}
    if architecture not in inverses:
        raise UnsupportedModel(
            f"architecture {architecture!r} with {EXPORTED_CONFIG}: ordinal export writes only "
            f"{sorted(inverses)}"
        )
    try:
        config = ModelConfig.from_dict(hf_config[EXPORTED_CONFIG])
    except (ValueError, TypeError, AttributeError) as error:
        message = f"config.json's {EXPORTED_CONFIG} is not a config: {error}"
        raise UnsupportedModel(message) from None
    check_fits_memory(expected_shapes(config))  # before its model is built
    model = Transformer(config)
    native, why_not = native_for(model)
    if architecture != CUSTOM_ARCHITECTURE and native != architecture:
        raise UnsupportedModel(
            f"{EXPORTED_CONFIG}'s {config.scheme} is never exported as {architecture}: "
            f"{why_not or f'it exports as {native}'}"
        )
    check_shapes(inverses[architecture](_Tensors(read_safetensors_shapes(folder)), config), config)
    folder_tensors = read_safetensors(folder)
    state = inverses[architecture](_Tensors(folder_tensors), config)
    missing = sorted(set(model.state_dict()) - set(state))
    if missing:
        raise UnsupportedModel(
            f"{architecture} does not hold {config.scheme}'s {missing} (the export lost them)"
        )
    _load_exactly(model, {name: state[name] for name in model.state_dict()})
    tokenizer, tokenizer_config = read_tokenizer(folder, hf_config, config.vocab_size)
    _check_exports_as(folder, hf_config, folder_tensors, model, tokenizer)
    tokenizer_config["chat_template"] = checkpoint_chat_template(tokenizer_config["chat_template"])
    storage = dtype or config.dtype
    if dtype is None:  # the checkpoint's own dtype, only if it holds every weight exactly
        _check_fits(model, storage)
    save_checkpoint(out, model, tokenizer, storage, tokenizer_config=tokenizer_config)
    return config.replace(dtype=storage)


def _check_exports_as(
    folder: SourceFolder,
    hf_config: dict[str, Any],
    tensors: dict[str, Tensor],
    model: Transformer,
    tokenizer: Tokenizer,
) -> None:
    """An UnsupportedModel unless exporting ``model`` again writes exactly the folder's
    config.json and tensors: the import is then the model the folder computes."""
    target = "custom" if hf_config["architectures"] == [CUSTOM_ARCHITECTURE] else "native"
    try:
        again = export_model(model, tokenizer, target)
    except ValueError as error:
        message = f"{EXPORTED_CONFIG} exports as no {target} folder: {error}"
        raise UnsupportedModel(message) from None
    not_export = f"{folder.path} is not what ordinal export writes for its {EXPORTED_CONFIG}"
    if again.architecture != hf_config["architectures"][0]:
        raise UnsupportedModel(f"{not_export}: that exports as {again.architecture}")
    for key in sorted(set(hf_config) | set(again.config)):
        if key not in SAVE_METADATA and hf_config.get(key) != again.config.get(key):
            raise UnsupportedModel(
                f"{not_export}: config.json's {key} is {hf_config.get(key)!r}, the export's "
                f"{again.config.get(key)!r} (imported, it would be another model)"
            )
    expected = float32_copies(again.tensors)
    for name in sorted(set(tensors) | set(expected)):
        if name not in tensors or name not in expected:
            where = "has no" if name not in tensors else "has a tensor the export does not write:"
            raise UnsupportedModel(f"{not_export}: it {where} {name!r}")
        if not torch.equal(tensors[name].float(), expected[name]):
            raise UnsupportedModel(
                f"{not_export}: its tensor {name!r} differs from the export's (imported, it "
                f"would be another model)"
            )


def _check_fits(model: Transformer, dtype: str) -> None:
    """An UnsupportedModel unless every weight of ``model`` is exactly a ``dtype`` number."""
    storage = resolve_dtype(dtype)
    for name, tensor in model.state_dict().items():
        if not torch.equal(tensor.to(storage).to(tensor.dtype), tensor):
            raise UnsupportedModel(
                f"tensor {name!r} is not exactly {dtype}, the dtype {EXPORTED_CONFIG} records "
                f"(the weights changed since the export?): pass --dtype float32 to keep them"
            )


def ordinal_weights(tensors: _Tensors, config: ModelConfig) -> dict[str, Tensor]:
    """The custom-code folder's tensors: ordinal's own names, the tied output not stored."""
    state = {name: tensors.take(name) for name in tensors.names() if name != "lm_head.weight"}
    _add_output(state, tensors, config)
    return state


def nemotron_weights(tensors: _Tensors, config: ModelConfig) -> dict[str, Tensor]:
    """``interop.hf_export.nemotron`` inverted: norms get their 1 back (LayerNorm1P),
    q, k and v are fused again; the zero biases are kept for the export check to see."""
    tensors.strip_prefix("model.")
    state = {"token_embedding.weight": tensors.take("embed_tokens.weight")}

    def norm(theirs: str, ours: str) -> None:
        state[f"{ours}.weight"] = tensors.take(f"{theirs}.weight") + 1.0
        state[f"{ours}.bias"] = tensors.take(f"{theirs}.bias")

    for layer in range(config.n_layers):
        theirs, ours = f"layers.{layer}.", f"blocks.{layer}."
        norm(f"{theirs}input_layernorm", f"{ours}attention_norm")
        norm(f"{theirs}post_attention_layernorm", f"{ours}mlp_norm")
        kinds = ("weight", "bias") if config.bias else ("weight",)
        for kind in kinds:
            state[f"{ours}attention.qkv.{kind}"] = torch.cat(
                [tensors.take(f"{theirs}self_attn.{name}_proj.{kind}") for name in "qkv"]
            )
            for mine, hers in [("attention.proj", "self_attn.o_proj"), ("mlp.up", "mlp.up_proj")]:
                state[f"{ours}{mine}.{kind}"] = tensors.take(f"{theirs}{hers}.{kind}")
            state[f"{ours}mlp.down.{kind}"] = tensors.take(f"{theirs}mlp.down_proj.{kind}")
    norm("norm", "final_norm")
    _add_output(state, tensors, config)
    return state


def gpt2_export_weights(tensors: _Tensors, config: ModelConfig) -> dict[str, Tensor]:
    """``interop.hf_export.gpt2`` inverted: GPT-2's weights (:func:`gpt2_weights`), the
    position table ordinal's learned table; a scheme with other parameters was baked into it."""
    with torch.device("meta"):  # its tensors' names only: nothing allocated
        names = list(build_scheme(config).state_dict())
    baked = [name for name in names if config.scheme != "learned" or name != "table"]
    if baked:
        raise UnsupportedModel(
            f"this GPT2LMHeadModel export of {config.scheme} is lossy: {config.scheme}'s "
            f"{baked} were baked into GPT-2's position table, which does not determine them, so "
            f"it cannot import back as {config.scheme} (export with --target custom for a folder "
            f"that does)"
        )
    return gpt2_weights(tensors, config)


# How each native architecture ``ordinal export`` writes is mapped back.
EXPORT_INVERSES: dict[str, Callable[[_Tensors, ModelConfig], dict[str, Tensor]]] = {
    "NemotronForCausalLM": nemotron_weights,
    "GPT2LMHeadModel": gpt2_export_weights,
}


# ----------------------------------------------------------------------------------------------
# Reading the folder


@dataclass(frozen=True)
class SourceFolder:
    """The folder an import reads, and the folder every file it reads must lie in once its
    symlinks are followed: the folder itself, or for a hub download its repository's cache
    folder (the snapshot's files are symlinks to the blobs beside it).

    A cloned model repository keeps its symlinks, and an index may name any path: followed
    blindly, a ``chat_template.jinja`` linked to a private file would be published inside the
    checkpoint. So every path goes through :meth:`file`."""

    path: Path
    root: Path

    @classmethod
    def local(cls, path: Path) -> SourceFolder:
        return cls(path, path.resolve())

    def file(self, name: str) -> Path:
        """``path / name``, or an UnsupportedModel when ``name`` is absolute or it (a ``..``,
        a symlink on the way) leads out of ``root``."""
        if Path(name).is_absolute():
            raise UnsupportedModel(
                f"{self.path} names the file {name!r} by an absolute path: an import reads only "
                "files inside the folder"
            )
        path = self.path / name
        if not path.resolve().is_relative_to(self.root):
            raise UnsupportedModel(
                f"{path} leads outside {self.path} (a symlink or '..'): an import reads only "
                "files inside the folder"
            )
        return path

    def has(self, name: str) -> bool:
        """Whether the folder has an entry ``name`` (a symlink counts, wherever it points:
        :meth:`file` then refuses one that leads out)."""
        return os.path.lexists(self.path / name)


def resolve_folder(source: str) -> SourceFolder:
    """``source`` as a local folder; a hub name ("owner/model") with no such folder is
    downloaded (config, safetensors and tokenizer files only) when the hub can be reached."""
    path = Path(source).expanduser()
    if path.is_dir():
        return SourceFolder.local(path)
    looks_like_hub_name = source.count("/") == 1 and not source.startswith((".", "/", "~"))
    if path.exists() or not looks_like_hub_name:
        raise UnsupportedModel(f"{source} is not a folder (give a Hugging Face model folder)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise UnsupportedModel(
            f"no folder {source}, and huggingface_hub is not installed to fetch it from the hub"
        ) from None
    try:
        snapshot = Path(snapshot_download(source, allow_patterns=HUB_FILES))
    except Exception as error:  # offline, unknown repository, gated, ...: all the user's to fix
        raise UnsupportedModel(
            f"no folder {source}, and fetching it from the Hugging Face hub failed: {error}"
        ) from None
    # The hub's cache: REPO/snapshots/REVISION/NAME → REPO/blobs/HASH, links the hub made.
    return SourceFolder(snapshot, snapshot.parent.parent.resolve())


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UnsupportedModel(f"{path.parent} is not a Hugging Face model folder: no {path.name}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UnsupportedModel(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise UnsupportedModel(f"{path} must hold a JSON object")
    return data


def _architecture(hf_config: dict[str, Any]) -> str:
    architectures = hf_config.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in FAMILIES:
        raise UnsupportedModel(
            f"architecture {architectures!r} (model_type {hf_config.get('model_type')!r}) is not "
            f"importable; importable: {sorted(FAMILIES)}"
        )
    return architectures[0]


def _require(hf: dict[str, Any], key: str, value: Any, why: str) -> None:
    """An UnsupportedModel naming ``key`` unless the config's value (absent: ``value``) is
    ``value``."""
    found = hf.get(key, value)
    if found != value:
        raise UnsupportedModel(f"{key}={found!r} is not supported ({why})")


def _storage_dtype(hf: dict[str, Any]) -> str:
    """The dtype the folder stores (``dtype``, formerly ``torch_dtype``), if the core has it."""
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return dtype if dtype in DTYPES else "float32"


def _weight_files(folder: SourceFolder) -> list[Path]:
    """The folder's safetensors files: ``model.safetensors``, or the shards its index names
    (each checked to lie inside the folder before any is read)."""
    if folder.has(HF_WEIGHTS_INDEX):
        weight_map = _read_json(folder.file(HF_WEIGHTS_INDEX)).get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) for name in weight_map.values()
        ):
            raise UnsupportedModel(f"{folder.path / HF_WEIGHTS_INDEX}: weight_map must map names")
        files = sorted(set(weight_map.values()))
    elif folder.has(HF_WEIGHTS_FILE):
        files = [HF_WEIGHTS_FILE]
    else:
        raise UnsupportedModel(
            f"{folder.path} has no {HF_WEIGHTS_FILE} (only safetensors weights import; "
            f"pytorch_model.bin is not read)"
        )
    return [folder.file(name) for name in files]


def read_safetensors(folder: SourceFolder) -> dict[str, Tensor]:
    """Every tensor of the folder (:func:`_weight_files`)."""
    tensors: dict[str, Tensor] = {}
    for path in _weight_files(folder):
        try:
            tensors |= load_file(path)
        except (SafetensorError, OSError) as error:
            message = f"{path} is not a readable safetensors file: {error}"
            raise UnsupportedModel(message) from None
    return tensors


def read_safetensors_shapes(folder: SourceFolder) -> dict[str, Tensor]:
    """Every tensor of the folder as a meta tensor (float32) of its shape, from the files'
    headers alone: no weight is read, nothing allocated."""
    tensors: dict[str, Tensor] = {}
    for path in _weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as weights:
                for name in weights.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    shape = weights.get_slice(name).get_shape()
                    tensors[name] = torch.empty(shape, device="meta")
        except (SafetensorError, OSError) as error:
            message = f"{path} is not a readable safetensors file: {error}"
            raise UnsupportedModel(message) from None
    return tensors


def check_shapes(state: dict[str, Tensor], config: ModelConfig) -> None:
    """An UnsupportedModel unless each tensor of ``state`` that a model of ``config`` has is of
    the shape the config implies, and that model fits in memory (:func:`check_fits_memory`).
    From shapes alone (``model.checkpoint.expected_shapes``: a one-block model on the meta
    device), so a config claiming huge sizes is refused in milliseconds, where building its
    model first took a 13 GB allocation and ended in the allocator's traceback. Names it has no
    place for are the caller's (an export's zero biases are dropped)."""
    expected = expected_shapes(config)
    if config.tie_embeddings:  # the output matrix is the embedding, not stored apart
        expected["lm_head.weight"] = expected["token_embedding.weight"]
    for name, tensor in state.items():
        if name in expected and tuple(tensor.shape) != expected[name]:
            raise UnsupportedModel(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies "
                f"{expected[name]}"
            )
    check_fits_memory(expected)


def check_fits_memory(shapes: dict[str, tuple[int, ...]]) -> None:
    """An UnsupportedModel when the import of a model of these tensor ``shapes`` would take more
    memory than is available (``model.memory``): its weights read as float32, and the model
    they are copied into."""
    needed = 2 * 4 * sum(math.prod(shape) for shape in shapes.values())
    available = available_memory()
    if available is not None and needed > available:
        raise UnsupportedModel(
            f"importing this model takes {needed / 2**30:.1f} GiB (its weights read, and its "
            f"model) but only {available / 2**30:.1f} GiB of memory is available "
            f"{where_memory_ends()}"
        )


class _Tensors:
    """The folder's tensors, taken one by one; what is never taken is an error (the core would
    silently drop a weight the source model uses)."""

    def __init__(self, tensors: dict[str, Tensor]) -> None:
        self._left = dict(tensors)

    def strip_prefix(self, prefix: str) -> None:
        self._left = {name.removeprefix(prefix): tensor for name, tensor in self._left.items()}

    def names(self) -> list[str]:
        return list(self._left)

    def take(self, name: str) -> Tensor:
        if name not in self._left:
            raise UnsupportedModel(f"tensor {name!r} is missing from the weights")
        return self._left.pop(name).float()

    def discard(self, unused: Callable[[str], bool]) -> None:
        self._left = {name: tensor for name, tensor in self._left.items() if not unused(name)}

    def check_all_taken(self, architecture: str) -> None:
        if self._left:
            raise UnsupportedModel(
                f"tensor {sorted(self._left)[0]!r} has no place in the core's {architecture} "
                f"({len(self._left)} such tensor(s))"
            )


def _load_exactly(model: Transformer, state: dict[str, Tensor]) -> None:
    """Copy ``state`` into ``model``, each tensor's shape checked first (a message naming it)."""
    expected = model.state_dict()
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise UnsupportedModel(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(expected[name].shape)}"
            )
    model.load_state_dict(state)


def read_tokenizer(
    folder: SourceFolder, hf_config: dict[str, Any], vocab_size: int
) -> tuple[Tokenizer, dict[str, Any]]:
    """The folder's tokenizer, ready for ordinal, and the tokenizer_config.json to record with
    it: its bos, eos and pad tokens and the folder's chat template (else ordinal's). Files
    larger than a tokenizer of ``vocab_size`` tokens are refused unread."""
    if not folder.has(TOKENIZER_FILE):
        raise UnsupportedModel(f"{folder.path} has no {TOKENIZER_FILE} (the fast tokenizer's file)")
    path = folder.file(TOKENIZER_FILE)
    try:
        check_tokenizer_size(path, vocab_size)
    except TokenizerError as error:
        raise UnsupportedModel(str(error)) from None
    data = _read_json(path)
    # ordinal places bos itself and never truncates or pads a prompt behind the caller's back.
    data.update(post_processor=None, truncation=None, padding=None)
    try:
        tokenizer = Tokenizer.from_str(json.dumps(data))
    except Exception as error:  # tokenizers raises a bare Exception
        raise UnsupportedModel(f"{path} is not a valid tokenizer file: {error}") from None
    hf_tokenizer_config = (
        _read_json(folder.file(HF_TOKENIZER_CONFIG)) if folder.has(HF_TOKENIZER_CONFIG) else {}
    )
    names = special_token_names(hf_tokenizer_config) or _special_names_from_ids(
        tokenizer, hf_config
    )
    name_special_tokens(tokenizer, names)
    special_ids(tokenizer)  # each is in the vocabulary
    token_bytes(tokenizer)  # byte-level, so ordinal can decode and stream it
    template = hf_tokenizer_config.get("chat_template")
    if folder.has(HF_CHAT_TEMPLATE):
        template = folder.file(HF_CHAT_TEMPLATE).read_text(encoding="utf-8")
    return tokenizer, {  # Hugging Face's keys, the tokenizer's own specials, its template
        **default_tokenizer_config(),
        **special_token_config(tokenizer),
        "chat_template": template if isinstance(template, str) else DEFAULT_TEMPLATE,
    }


def _special_names_from_ids(
    tokenizer: Tokenizer, hf_config: dict[str, Any]
) -> tuple[str, str, str]:
    """(bos, eos, pad) from config.json's ``bos_token_id`` and ``eos_token_id``."""
    names = []
    for key in ("bos_token_id", "eos_token_id"):
        id_ = hf_config.get(key)
        name = tokenizer.id_to_token(id_) if isinstance(id_, int) else None
        if name is None:
            raise UnsupportedModel(
                f"the tokenizer's {key.removesuffix('_id')} is unknown: tokenizer_config.json "
                f"names none, and config.json's {key}={id_!r} is not in the vocabulary"
            )
        names.append(name)
    return names[0], names[1], names[1]
