"""Checkpoint folders: config.json + model.safetensors + tokenizer.json, written atomically.

Loading checks every tensor's name, shape and dtype against the config before any weight is used
and names the first bad tensor; a file cut short is caught from the safetensors header, so the
message can say which tensor is missing its bytes. Saving builds the whole folder beside the old
one and swaps it in with renames, so a crash leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from model.config import ConfigError, ModelConfig
from model.tokenizer import load_tokenizer
from model.transformer import Transformer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
CHECKPOINT_FILES = (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


class CheckpointError(ValueError):
    """A checkpoint folder is missing, corrupt or does not match its config."""


class LoadedCheckpoint(NamedTuple):
    model: Transformer
    tokenizer: Tokenizer


def default_device() -> torch.device:
    """cuda when available, else cpu."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {name!r}")
    return DTYPES[name]


def stored_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores: the state dict without the tied output matrix."""
    state = model.state_dict()
    if model.config.tie_embeddings:
        state.pop("lm_head.weight")
    return state


def save_checkpoint(
    path: str | Path, model: Transformer, tokenizer: Tokenizer, dtype: str | None = None
) -> None:
    """Write ``model`` and ``tokenizer`` to the folder ``path`` atomically.

    ``dtype`` is the storage dtype (default: the config's). Other files already in the folder
    (metrics.json, eval.json, …) are carried over into the new one.
    """
    path = Path(path)
    config = model.config if dtype is None else model.config.replace(dtype=dtype)
    storage = resolve_dtype(config.dtype)
    tensors = {
        name: tensor.detach().to("cpu", storage).contiguous()
        for name, tensor in stored_tensors(model).items()
    }
    staging = path.parent / f".{path.name}.saving-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        config.save(staging / CONFIG_FILE)
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        tokenizer.save(str(staging / TOKENIZER_FILE))
        if path.exists():
            for extra in path.iterdir():
                if extra.name not in CHECKPOINT_FILES and extra.is_file():
                    shutil.copy2(extra, staging / extra.name)
        _fsync_folder(staging)
        for file in staging.iterdir():
            file.chmod(0o644)
        _swap_in(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _swap_in(staging: Path, path: Path) -> None:
    """Replace ``path`` by ``staging`` with two renames (each atomic on one filesystem)."""
    retired = path.parent / f".{path.name}.old-{os.getpid()}"
    if path.exists():
        os.replace(path, retired)
    os.replace(staging, path)
    shutil.rmtree(retired, ignore_errors=True)


def _fsync_folder(folder: Path) -> None:
    for file in folder.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())


def load_checkpoint(
    path: str | Path,
    device: str | torch.device | None = None,
    dtype: str = "float32",
    positional_overrides: dict[str, Any] | None = None,
) -> LoadedCheckpoint:
    """Load a checkpoint folder → (model in eval mode, tokenizer).

    ``dtype`` is the run dtype, independent of the stored one. ``positional_overrides`` changes
    positional parameters at load time, e.g. ``{"scaling": "ntk", "scaling_factor": 4.0}`` to let
    a rope model serve 4× its training context.
    """
    path = Path(path)
    for name in CHECKPOINT_FILES:
        if not (path / name).is_file():
            raise CheckpointError(f"{path} is not a checkpoint: {name} is missing")
    try:
        config = ModelConfig.load(path / CONFIG_FILE)
        if positional_overrides:
            config = config.replace(positional={**config.positional, **positional_overrides})
    except ConfigError as error:
        raise CheckpointError(f"{path / CONFIG_FILE}: {error}") from None

    weights_path = path / WEIGHTS_FILE
    check_weights(weights_path, config)
    tensors = load_file(str(weights_path))
    if config.tie_embeddings:
        tensors["lm_head.weight"] = tensors["token_embedding.weight"]

    tokenizer = load_tokenizer(path / TOKENIZER_FILE)
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise CheckpointError(
            f"{path / TOKENIZER_FILE} has {tokenizer.get_vocab_size()} tokens but the model's "
            f"vocab_size is {config.vocab_size}"
        )

    model = Transformer(config)
    model.load_state_dict(tensors)
    model.to(device=device or default_device(), dtype=resolve_dtype(dtype))
    return LoadedCheckpoint(model.eval(), tokenizer)


def check_weights(weights_path: Path, config: ModelConfig) -> None:
    """Check names, shapes, dtypes and byte ranges in ``weights_path`` against ``config``."""
    header, data_size = _read_header(weights_path)
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in stored_tensors(Transformer(config)).items()}
    missing = sorted(set(expected) - set(header))
    if missing:
        raise CheckpointError(f"{weights_path}: tensor {missing[0]!r} is missing")
    unexpected = sorted(set(header) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"{weights_path}: unexpected tensor {unexpected[0]!r} (not part of a "
            f"'{config.scheme}' model with this config)"
        )
    for name, shape in expected.items():
        entry = header[name]
        if tuple(entry["shape"]) != shape:
            raise CheckpointError(
                f"{weights_path}: tensor {name!r} has shape {tuple(entry['shape'])}, "
                f"the config expects {shape}"
            )
        stored = SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"])
        if stored != config.dtype:
            raise CheckpointError(
                f"{weights_path}: tensor {name!r} is stored as {stored}, config.json says "
                f"{config.dtype}"
            )
        if entry["data_offsets"][1] > data_size:
            raise CheckpointError(
                f"{weights_path}: tensor {name!r} is cut short (the file is truncated)"
            )


def _read_header(weights_path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors JSON header (name → dtype, shape, data_offsets) and the data size."""
    file_size = weights_path.stat().st_size
    with open(weights_path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{weights_path} is truncated: no safetensors header")
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > file_size - 8:
            raise CheckpointError(f"{weights_path} is truncated inside its header")
        try:
            header = json.loads(handle.read(header_size))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{weights_path} has a corrupt safetensors header") from None
    header.pop("__metadata__", None)
    return header, file_size - 8 - header_size
