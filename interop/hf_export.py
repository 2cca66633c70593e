"""``ordinal export``: a checkpoint as a Hugging Face folder that transformers, vLLM and
TransformerLens load, computing what ordinal computes.

Where an architecture they know is exactly ordinal's model, the folder is that architecture
(:data:`NATIVE`), its weights renamed and reshaped:

- rope → ``NemotronForCausalLM``: pre-norm LayerNorm blocks whose norm is stored as weight − 1
  (Nemotron's LayerNorm1P adds the 1 back), an ungated MLP (``relu2`` is ReLU², as ordinal's),
  NeoX-layout rotation of the first ``partial_rotary_factor`` of each head, tied embeddings;
- table schemes (learned, mds, lowrank) and none → ``GPT2LMHeadModel``: the scheme's vectors for
  positions 0..n_positions−1 become GPT-2's position table (zeros for none, so positions stop
  at n_positions there), GPT-2's biases are zero where ordinal has none, Conv1D weights are
  ordinal's transposed.

Anything else (alibi, t5 and fire, biases on the scores; fox and cope, whose biases each layer
computes from its own queries and keys; irope, rope in some layers only; stick-breaking, which
replaces softmax; the formula schemes whose positions have no last row; or a config the native
architecture cannot express: p-RoPE's unturned pairs, RMSNorm, SwiGLU, query/key norm, a rope
scaling without an equal Hugging Face rope type) is written as custom code:
``remote/modeling_ordinal.py``, a self-contained port loaded with ``trust_remote_code=True``,
holding ordinal's own tensor names. ``--target custom`` writes every scheme that way;
``--target native`` refuses a checkpoint that has no exact native architecture, saying why.

Every folder also carries ``config.json`` ``ordinal_config`` (the checkpoint's own config, so an
import can restore it), a tokenizer that adds ``<|bos|>`` as ordinal does, and a chat template
that renders ordinal's scene with Hugging Face's defaults (:func:`hf_chat_template`). Weights
are float32. The folder is written beside ``OUT`` and swapped in whole
(``model.checkpoint.staged_folder``), where ``model.files.check_output`` allows: never over or
inside a checkpoint, over a folder other than an earlier export only with ``--force``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save as serialise_tensors
from tokenizers import Tokenizer
from torch import Tensor

from model.chat import DEFAULT_SPEAKERS, TOKENIZER_CONFIG_FILE, ChatTemplate
from model.checkpoint import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    load_checkpoint,
    staged_folder,
    stored_tensors,
)
from model.config import ModelConfig
from model.files import OutputKind, check_output, only_files, read_json_object
from model.positional import positions_table
from model.positional.rope import RotaryPositions
from model.tokenizer import BOS, EOS, PAD, special_ids, with_bos
from model.transformer import Block, Transformer

TARGETS = ("auto", "native", "custom")
FORMATS = ("hf", "gguf")  # a Hugging Face folder; a llama.cpp file (interop.gguf_export)
REMOTE_CODE = Path(__file__).parent / "remote"
REMOTE_FILES = ("configuration_ordinal.py", "modeling_ordinal.py")
CUSTOM_ARCHITECTURE = "OrdinalForCausalLM"
EXPORTED_CONFIG = "ordinal_config"  # config.json's key: the checkpoint's own config, for an import
# ordinal's MLPs that are ungated, by their name in transformers' ACT2FN (the same function).
UNGATED_ACTIVATIONS = {"relu2": "relu2", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
# The ModelConfig fields every exported architecture reads. Any other field (one added to the
# model core later) must keep its default, or no export is known to be exact.
EXPORTED_FIELDS = {
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "d_ff",
    "context_length",
    "max_positions",
    "dropout",  # training only
    "norm",
    "mlp",
    "bias",
    "tie_embeddings",
    "qk_norm",
    "positional",
    "dtype",  # the stored dtype; an export is float32
}
# How far a formula scheme is served by default (server.engine.loader.context_limit: 4 × the
# trained context), which is what an export declares as its reach.
SERVED_CONTEXT_MULTIPLE = 4


class ExportError(ValueError):
    """The checkpoint cannot be written as asked (no exact architecture, an unknown field)."""


@dataclass(frozen=True)
class Exported:
    """What a folder holds: its architecture, config.json and weights, and why it is that one."""

    architecture: str
    config: dict[str, Any]
    tensors: dict[str, Tensor]
    reason: str  # why this architecture (for custom code: why no native one)

    @property
    def native(self) -> bool:
        return self.architecture != CUSTOM_ARCHITECTURE


# ----------------------------------------------------------------------------------------------
# What maps exactly


# The schemes the custom-code port (remote/modeling_ordinal.py) computes, each with every one of
# its parameters (tests/interop/test_export.py checks both against the port and the registry).
# A scheme registered since is refused until the port has it.
PORTED_SCHEMES = (
    "none", "integer", "binary", "sinusoidal", "learned", "rope", "alibi", "t5", "mds", "lowrank",
    "fox", "cope", "fire", "irope", "stickbreaking", "pope", "path", "pathfox",
)  # fmt: skip


def unported_positional(config: ModelConfig) -> str | None:
    """Why no export computes ``config``'s positional scheme exactly, or None."""
    if config.scheme not in PORTED_SCHEMES:
        return f"scheme {config.scheme!r} has no Hugging Face export yet (ported: {PORTED_SCHEMES})"
    return None


def unexported_fields(config: ModelConfig) -> list[str]:
    """Config fields no export reads, set to something other than their default."""
    return [
        field.name
        for field in dataclasses.fields(config)
        if field.name not in EXPORTED_FIELDS
        and getattr(config, field.name) != ModelConfig.__dataclass_fields__[field.name].default
    ]


def _block_mismatch(config: ModelConfig, architecture: str) -> str | None:
    """Why ordinal's blocks are not ``architecture``'s (LayerNorm, ungated MLP), or None."""
    if config.norm != "layernorm":
        return f"{architecture} normalises with LayerNorm, this checkpoint with {config.norm}"
    if config.mlp not in UNGATED_ACTIVATIONS:
        return f"{architecture}'s MLP is ungated, this checkpoint's is {config.mlp}"
    if config.qk_norm:
        return f"{architecture} has no query/key norm (this checkpoint has qk_norm)"
    return None


def nemotron_mismatch(model: Transformer) -> str | None:
    """Why ``model`` is not exactly a NemotronForCausalLM, or None when it is."""
    config, scheme = model.config, model.positional
    # by name: a scheme built on rope's module (a subclass) is another scheme
    if config.scheme != "rope" or not isinstance(scheme, RotaryPositions):
        left_out = [layer for layer in range(config.n_layers) if not scheme.acts_at(layer)]
        if isinstance(scheme, RotaryPositions) and left_out:
            return (
                f"NemotronForCausalLM rotates queries and keys in every layer alike; "
                f"{config.scheme} leaves layers {left_out} unrotated (NoPE)"
            )
        return f"NemotronForCausalLM rotates queries and keys (rope); this is {config.scheme}"
    if scheme.kept_pairs < scheme.rotary_dim // 2:
        return (
            f"p-RoPE (fraction {scheme.params.fraction}) leaves its slowest pairs unturned; "
            "NemotronForCausalLM turns every pair it rotates"
        )
    mismatch = _block_mismatch(config, "NemotronForCausalLM")
    if mismatch:
        return mismatch
    # transformers, vLLM and llama.cpp all take int(head_dim × factor) dims as the rotated ones
    factor = scheme.rotary_dim / config.head_dim
    if int(config.head_dim * factor) != scheme.rotary_dim:
        return f"rotary_dim {scheme.rotary_dim} is not int(head_dim × {factor}) in floating point"
    if scheme.params.scaling not in (None, "ntk", "linear"):
        return (
            f"rope scaling {scheme.params.scaling!r} has no Hugging Face rope type known to "
            "compute exactly ordinal's angles"
        )
    return None


def gpt2_mismatch(model: Transformer) -> str | None:
    """Why ``model`` is not exactly a GPT2LMHeadModel, or None when it is."""
    config, scheme = model.config, model.positional
    probe = positions_table(2)
    acts_inside = (
        scheme.data_dependent  # fox, cope: a bias from each layer's queries and keys
        or scheme.replaces_softmax  # stick-breaking: its own weights, not softmax's
        or scheme.rotation(probe) is not None
        or scheme.attention_bias(probe, probe[0]) is not None
    )
    if acts_inside:
        return f"GPT-2 only adds a vector per position; {config.scheme} acts inside attention"
    if scheme.embedding(probe) is not None and not scheme.is_table:
        return (
            f"GPT-2's positions are a table of n_positions rows; {config.scheme} is a formula "
            "defined for every position"
        )
    return _block_mismatch(config, "GPT2LMHeadModel")


def _zeros_unless(tensor: Tensor | None, size: int) -> Tensor:
    """``tensor`` (a bias ordinal has), or zeros where it has none and the target needs one."""
    return tensor.detach().float() if tensor is not None else torch.zeros(size)


def _common_config(model: Transformer, tokenizer: Tokenizer, architecture: str) -> dict[str, Any]:
    special = special_ids(tokenizer)
    return {
        "architectures": [architecture],
        "vocab_size": model.config.vocab_size,
        "bos_token_id": special.bos,
        "eos_token_id": special.eos,
        "pad_token_id": special.pad,
        "tie_word_embeddings": model.config.tie_embeddings,
        "torch_dtype": "float32",
        "use_cache": True,
        EXPORTED_CONFIG: model.config.to_dict(),
    }


def _untied_output(model: Transformer, name: str) -> dict[str, Tensor]:
    return {} if model.config.tie_embeddings else {name: model.lm_head.weight}


def _blocks(model: Transformer) -> list[Block]:
    return [cast(Block, block) for block in model.blocks]


def served_context(model: Transformer) -> int:
    """The positions an export declares: a table's rows, else what ordinal serves by default."""
    if model.positional.is_table:
        return model.config.max_positions
    limit = SERVED_CONTEXT_MULTIPLE * model.config.context_length
    cap = model.positional.max_positions
    return limit if cap is None else min(limit, cap)


def nemotron(model: Transformer, tokenizer: Tokenizer) -> Exported:
    config, scheme = model.config, model.positional
    assert isinstance(scheme, RotaryPositions)
    norm_eps = model.final_norm.eps
    hf_config = {
        **_common_config(model, tokenizer, "NemotronForCausalLM"),
        "model_type": "nemotron",
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_heads,
        "head_dim": config.head_dim,
        "hidden_act": UNGATED_ACTIVATIONS[config.mlp],
        "max_position_embeddings": served_context(model),
        "norm_eps": norm_eps,
        "rope_theta": scheme.base,  # ntk is a larger base, already in scheme.base
        "partial_rotary_factor": scheme.rotary_dim / config.head_dim,
        "attention_bias": config.bias,
        "mlp_bias": config.bias,
        "attention_dropout": 0.0,
    }
    if scheme.params.scaling == "linear":
        factor = scheme.params.scaling_factor
        hf_config["rope_scaling"] = {"rope_type": "linear", "type": "linear", "factor": factor}
    d = config.d_model
    tensors = {"model.embed_tokens.weight": model.token_embedding.weight}

    def norm(prefix: str, module: Any) -> None:  # LayerNorm1P: Nemotron adds the 1 back
        tensors[f"{prefix}.weight"] = module.weight.detach().float() - 1.0
        tensors[f"{prefix}.bias"] = _zeros_unless(module.bias, d)

    for i, block in enumerate(_blocks(model)):
        layer = f"model.layers.{i}"
        norm(f"{layer}.input_layernorm", block.attention_norm)
        norm(f"{layer}.post_attention_layernorm", block.mlp_norm)
        attention, mlp = block.attention, block.mlp
        for name, weight in zip("qkv", attention.qkv.weight.chunk(3), strict=True):
            tensors[f"{layer}.self_attn.{name}_proj.weight"] = weight
        tensors[f"{layer}.self_attn.o_proj.weight"] = attention.proj.weight
        tensors[f"{layer}.mlp.up_proj.weight"] = mlp.up.weight
        tensors[f"{layer}.mlp.down_proj.weight"] = mlp.down.weight
        if config.bias:
            assert attention.qkv.bias is not None  # config.bias: every Linear has one
            for name, bias in zip("qkv", attention.qkv.bias.chunk(3), strict=True):
                tensors[f"{layer}.self_attn.{name}_proj.bias"] = bias
            tensors[f"{layer}.self_attn.o_proj.bias"] = attention.proj.bias
            tensors[f"{layer}.mlp.up_proj.bias"] = mlp.up.bias
            tensors[f"{layer}.mlp.down_proj.bias"] = mlp.down.bias
    norm("model.norm", model.final_norm)
    tensors.update(_untied_output(model, "lm_head.weight"))
    reason = "rope with LayerNorm and an ungated MLP is Nemotron's architecture"
    return Exported("NemotronForCausalLM", hf_config, tensors, reason)


def gpt2(model: Transformer, tokenizer: Tokenizer) -> Exported:
    config = model.config
    n_positions = served_context(model)
    vectors = model.positional.embedding(positions_table(n_positions))
    table = torch.zeros(n_positions, config.d_model) if vectors is None else vectors[0]
    hf_config = {
        **_common_config(model, tokenizer, "GPT2LMHeadModel"),
        "model_type": "gpt2",
        "n_embd": config.d_model,
        "n_layer": config.n_layers,
        "n_head": config.n_heads,
        "n_inner": config.d_ff,
        "n_positions": n_positions,
        "n_ctx": n_positions,
        "activation_function": UNGATED_ACTIVATIONS[config.mlp],
        "layer_norm_epsilon": model.final_norm.eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
    }
    d = config.d_model
    tensors = {
        "transformer.wte.weight": model.token_embedding.weight,
        "transformer.wpe.weight": table,
    }

    def norm(prefix: str, module: Any) -> None:
        tensors[f"{prefix}.weight"] = module.weight
        tensors[f"{prefix}.bias"] = _zeros_unless(module.bias, d)

    def conv1d(prefix: str, linear: torch.nn.Linear) -> None:  # GPT-2's Conv1D: x @ W, [in, out]
        tensors[f"{prefix}.weight"] = linear.weight.T
        tensors[f"{prefix}.bias"] = _zeros_unless(linear.bias, linear.out_features)

    for i, block in enumerate(_blocks(model)):
        layer = f"transformer.h.{i}"
        norm(f"{layer}.ln_1", block.attention_norm)
        conv1d(f"{layer}.attn.c_attn", block.attention.qkv)
        conv1d(f"{layer}.attn.c_proj", block.attention.proj)
        norm(f"{layer}.ln_2", block.mlp_norm)
        conv1d(f"{layer}.mlp.c_fc", block.mlp.up)
        conv1d(f"{layer}.mlp.c_proj", block.mlp.down)
    norm("transformer.ln_f", model.final_norm)
    tensors.update(_untied_output(model, "lm_head.weight"))
    what = "no positions" if vectors is None else f"a table of {n_positions} positions"
    reason = f"{config.scheme} adds {what}: GPT-2's learned-position table holds it"
    if vectors is None:
        reason += f" (as zeros; positions stop at n_positions = {n_positions})"
    return Exported("GPT2LMHeadModel", hf_config, tensors, reason)


def custom(model: Transformer, tokenizer: Tokenizer, reason: str) -> Exported:
    config = model.config
    hf_config = {
        **_common_config(model, tokenizer, CUSTOM_ARCHITECTURE),
        "model_type": "ordinal",
        "auto_map": {
            "AutoConfig": "configuration_ordinal.OrdinalConfig",
            "AutoModelForCausalLM": "modeling_ordinal.OrdinalForCausalLM",
        },
        **{
            key: value
            for key, value in config.to_dict().items()
            if key not in ("dropout", "dtype", "vocab_size")
        },
        "max_context": served_context(model),
    }
    return Exported(CUSTOM_ARCHITECTURE, hf_config, stored_tensors(model), reason)


# The native architectures, each with what tells whether a model is exactly it.
NATIVE: dict[str, tuple[Callable[[Transformer], str | None], Callable[..., Exported]]] = {
    "NemotronForCausalLM": (nemotron_mismatch, nemotron),
    "GPT2LMHeadModel": (gpt2_mismatch, gpt2),
}


def native_for(model: Transformer) -> tuple[str | None, str]:
    """The native architecture exactly equal to ``model`` (or None) and why (or why not)."""
    reasons = []
    for architecture, (mismatch, _) in NATIVE.items():
        why_not = mismatch(model)
        if why_not is None:
            return architecture, ""
        reasons.append(why_not)
    return None, "; ".join(reasons)


def export_model(model: Transformer, tokenizer: Tokenizer, target: str = "auto") -> Exported:
    """``model`` as a Hugging Face architecture: native where exact (``auto``), or as asked."""
    if target not in TARGETS:
        raise ExportError(f"target must be one of {list(TARGETS)}, got {target!r}")
    unknown = unexported_fields(model.config)
    if unknown:
        raise ExportError(f"no export knows the config field(s) {unknown}")
    why_not = unported_positional(model.config)
    if why_not is not None:
        raise ExportError(why_not)
    model = model.float().cpu()
    if target == "custom":
        return custom(model, tokenizer, "custom code was asked for (--target custom)")
    architecture, why_not = native_for(model)
    if architecture is not None:
        return NATIVE[architecture][1](model, tokenizer)
    if target == "native":
        raise ExportError(f"no native Hugging Face architecture is exact here: {why_not}")
    return custom(model, tokenizer, f"no native architecture is exact: {why_not}")


# ----------------------------------------------------------------------------------------------
# Tokenizer and chat template


def hf_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of ``tokenizer`` whose encode starts with <|bos|>, as ordinal's prompts do (as
    every saved tokenizer.json: ``model.tokenizer.with_bos``)."""
    return with_bos(tokenizer)


def hf_chat_template(source: str) -> str:
    """The checkpoint's template ``source`` with what ordinal's server passes it set inside.

    The server renders with ``speakers``, ``assistant_name`` (the last assistant message's
    speaker, upper-cased) and ``add_generation_prompt`` true, and puts <|bos|> before the text
    (here too, unless the template renders ``bos_token`` itself);
    Hugging Face passes only messages and the special tokens, so this prelude sets the rest and
    ``apply_chat_template`` gives the server's scene with its defaults. The scene always ends
    with the reply's speaker line, as the server renders it. ``developer`` speaks as system.
    """
    # The shipped template renders bos_token itself (for Hugging Face); an older one does not.
    bos = "" if "bos_token" in source else _BOS_LINE
    return _chat_prelude() + bos + source


_BOS_LINE = "{{- bos_token -}}\n"


def checkpoint_chat_template(template: str) -> str:
    """The checkpoint's own template inside ``template`` where :func:`hf_chat_template` wrote
    it (else ``template`` as it is): what importing an export records again."""
    if not template.startswith(_chat_prelude()):
        return template
    source = template.removeprefix(_chat_prelude())
    own = source.removeprefix(_BOS_LINE)
    return own if "bos_token" not in own else source


def _chat_prelude() -> str:
    speakers = {**DEFAULT_SPEAKERS, "developer": DEFAULT_SPEAKERS["system"]}
    return (
        f"{{%- set speakers = {json.dumps(speakers)} -%}}\n"
        '{%- set reply = namespace(name=speakers["assistant"]) -%}\n'
        '{%- for message in messages if message.role == "assistant" -%}\n'
        '{%- set reply.name = message.name or speakers["assistant"] -%}\n'
        "{%- endfor -%}\n"
        "{%- set assistant_name = reply.name | upper -%}\n"
        "{%- set add_generation_prompt = true -%}\n"
    )


def tokenizer_files(
    checkpoint: Path, tokenizer: Tokenizer, max_length: int
) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json, special_tokens_map.json and generation_config.json's contents."""
    special = special_ids(tokenizer)
    tokens = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    return {
        TOKENIZER_CONFIG_FILE: {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **tokens,
            "model_max_length": max_length,
            "clean_up_tokenization_spaces": False,
            "chat_template": hf_chat_template(ChatTemplate.from_checkpoint(checkpoint).source),
        },
        "special_tokens_map.json": tokens,
        "generation_config.json": {
            "bos_token_id": special.bos,
            "eos_token_id": special.eos,
            "pad_token_id": special.pad,
        },
    }


# ----------------------------------------------------------------------------------------------
# Writing


def float32_copies(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """float32, contiguous, each its own memory (safetensors refuses shared storage)."""
    return {
        name: t.detach().to("cpu", torch.float32).contiguous().clone()
        for name, t in tensors.items()
    }


# Every file an export folder holds (the remote code only for custom code).
FOLDER_FILES = (
    CONFIG_FILE,
    WEIGHTS_FILE,
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    "special_tokens_map.json",
    "generation_config.json",
    *REMOTE_FILES,
)


def not_an_export(path: Path) -> str | None:
    """Why ``path`` is not a folder ``ordinal export`` wrote (and nothing else), or None."""
    why_not = only_files(path, FOLDER_FILES)
    if why_not is None and EXPORTED_CONFIG not in (read_json_object(path / CONFIG_FILE) or {}):
        return f"its {CONFIG_FILE} has no {EXPORTED_CONFIG}"
    return why_not


HF_FOLDER = OutputKind("an ordinal export", folder=True, earlier=not_an_export)


def export_folder(
    checkpoint: str | Path, out: str | Path, target: str = "auto", *, force: bool = False
) -> Exported:
    """Write the checkpoint folder ``checkpoint`` as a Hugging Face folder at ``out``, where
    ``model.files.check_output`` allows it (``force``: over a folder that is not an export)."""
    checkpoint = Path(checkpoint)
    check_output(out, HF_FOLDER, sources=[checkpoint], force=force)
    model, tokenizer = load_checkpoint(checkpoint, device="cpu", dtype="float32")
    exported = export_model(model, tokenizer, target)
    weights = serialise_tensors(float32_copies(exported.tensors), metadata={"format": "pt"})
    with staged_folder(out) as staging:
        (staging / CONFIG_FILE).write_text(json.dumps(exported.config, indent=2) + "\n")
        (staging / WEIGHTS_FILE).write_bytes(weights)
        hf_tokenizer(tokenizer).save(str(staging / TOKENIZER_FILE))
        for name, content in tokenizer_files(checkpoint, tokenizer, served_context(model)).items():
            (staging / name).write_text(json.dumps(content, indent=2) + "\n")
        if not exported.native:
            for name in REMOTE_FILES:
                (staging / name).write_text((REMOTE_CODE / name).read_text())
    return exported


def run(args: argparse.Namespace) -> None:
    """``ordinal export CHECKPOINT OUT [--format hf|gguf] [--target auto|native|custom]
    [--force]``."""
    if args.format == "gguf":
        from interop.gguf_export import export_gguf

        export_gguf(args.checkpoint, args.out, force=args.force)
        print(f"{args.out}: llama.cpp GGUF, architecture nemotron")
        return
    exported = export_folder(args.checkpoint, args.out, args.target, force=args.force)
    how = "native" if exported.native else "custom code, load with trust_remote_code=True"
    print(f"{args.out}: {exported.architecture} ({how}): {exported.reason}")
