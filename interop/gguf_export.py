"""``ordinal export --format gguf``: a rope checkpoint as a GGUF file for llama.cpp.

llama.cpp's ``nemotron`` architecture is the model ``hf_export`` writes as NemotronForCausalLM,
so the tensors are that export's, named as llama.cpp's own converter names them
(``gguf.get_tensor_name_map``), with the LayerNorm weights stored whole (llama.cpp's converter
adds back the 1 that Hugging Face's LayerNorm1P leaves out) and the output matrix written out
even when tied. The tokenizer is written directly: ordinal's byte-level BPE vocabulary (the
strings of tokenizer.json, specials marked as control tokens) and its merges in rank order,
under the ``gpt-2`` pre-tokenizer, whose split (GPT-2's regular expression) is the one
``tokenizers``' ByteLevel pre-tokenizer makes, so llama.cpp tokenizes as ordinal does; a
<|bos|> is added before every prompt, as ordinal adds it. Schemes with no GGUF architecture
(every one but rope), and a rope nemotron does not compute exactly (p-RoPE's unturned pairs, a
scaling it lacks), are refused with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tokenizers import Tokenizer

from interop.hf_export import ExportError, hf_chat_template, nemotron, nemotron_mismatch
from model.chat import ChatTemplate
from model.checkpoint import load_checkpoint
from model.files import OutputKind, check_output, write_atomic
from model.positional.rope import RotaryPositions
from model.tokenizer import SPECIAL_TOKENS, special_ids

ARCHITECTURE = gguf.MODEL_ARCH.NEMOTRON
# llama.cpp's pre-tokenizer whose regular expression is GPT-2's, as ByteLevel(use_regex=True).
PRE_TOKENIZER = "gpt-2"
GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file


def vocabulary(tokenizer: Tokenizer, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(token strings by id, their GGUF token types, merges as "left right" in rank order).

    Ids past the tokenizer (embedding rows no text reaches) are unused placeholders."""
    by_id = {id_: token for token, id_ in tokenizer.get_vocab(with_added_tokens=True).items()}
    tokens: list[str] = []
    types: list[int] = []
    for id_ in range(vocab_size):
        token = by_id.get(id_)
        if token is None:
            tokens.append(f"[PAD{id_}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(token)
            control = token in SPECIAL_TOKENS
            types.append(gguf.TokenType.CONTROL if control else gguf.TokenType.NORMAL)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return tokens, types, [m if isinstance(m, str) else " ".join(m) for m in merges]


def gguf_tensors(hf_tensors: dict[str, Any], n_layers: int) -> dict[str, np.ndarray]:
    """Hugging Face Nemotron tensors → llama.cpp's names, float32 arrays in PyTorch's layout."""
    names = gguf.get_tensor_name_map(ARCHITECTURE, n_layers)
    out = {}
    for name, tensor in hf_tensors.items():
        data = tensor.detach().float()
        if name.endswith("norm.weight"):
            data = data + 1.0  # llama.cpp's LayerNorm is the plain one
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ExportError(f"llama.cpp's nemotron has no tensor for {name}")
        out[gguf_name] = data.contiguous().numpy()
    if "output.weight" not in out:  # tied: written out, as llama.cpp's loaders all find it
        out["output.weight"] = out["token_embd.weight"].copy()
    return out


def not_a_gguf(path: Path) -> str | None:
    """Why the file ``path`` is not a GGUF file, or None."""
    with open(path, "rb") as file:
        return None if file.read(len(GGUF_MAGIC)) == GGUF_MAGIC else "it does not start with GGUF"


GGUF_FILE = OutputKind("a GGUF file", folder=False, earlier=not_a_gguf)


def export_gguf(checkpoint: str | Path, out: str | Path, *, force: bool = False) -> None:
    """Write the rope checkpoint folder ``checkpoint`` as the GGUF file ``out`` (atomically),
    where ``model.files.check_output`` allows it (``force``: over a file that is not a GGUF)."""
    checkpoint = Path(checkpoint)
    check_output(out, GGUF_FILE, sources=[checkpoint], force=force)
    model, tokenizer = load_checkpoint(checkpoint, device="cpu", dtype="float32")
    if not isinstance(model.positional, RotaryPositions):
        raise ExportError(
            f"{checkpoint}: scheme {model.config.scheme!r} has no GGUF architecture: ordinal "
            "writes GGUF for rope only (llama.cpp's nemotron). Export a Hugging Face folder "
            "instead (without --format gguf)"
        )
    why_not = nemotron_mismatch(model)
    if why_not is not None:
        raise ExportError(f"{checkpoint} is not exactly llama.cpp's nemotron: {why_not}")
    exported = nemotron(model, tokenizer)
    config = exported.config
    special = special_ids(tokenizer)
    tokens, types, merges = vocabulary(tokenizer, model.config.vocab_size)
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[ARCHITECTURE])
    writer.add_name(checkpoint.resolve().name)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(model.config.vocab_size)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_eps(config["norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_rope_dimension_count(model.positional.rotary_dim)
    scaling = config.get("rope_scaling")
    if scaling is None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    else:  # linear: the only scaling nemotron_mismatch lets through besides ntk's base
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(special.bos)
    writer.add_eos_token_id(special.eos)
    writer.add_pad_token_id(special.pad)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(hf_chat_template(ChatTemplate.from_checkpoint(checkpoint).source))
    for name, array in gguf_tensors(exported.tensors, model.config.n_layers).items():
        writer.add_tensor(name, array)

    def write(staging: Path) -> None:
        writer.write_header_to_file(staging)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    write_atomic(out, write)
