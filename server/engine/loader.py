"""Loading the served checkpoints, in the engine process: the only place weights live.

Each model loads, or fails, on its own (the others still serve). Rope checkpoints are also
served under each configured context-extension variant (``rope+yarn4``), on the same weights.
The API process holds only tokenizers and what :class:`~server.messages.ModelInfo` says.

A device the machine lacks (``cuda`` without one) fails every model here, as any other load
failure does: the server still starts, and ``/health`` says why nothing serves.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

import model.kernels as kernels
from model.cache import KVCache
from model.checkpoint import load_checkpoint, with_positional
from model.device import resolve_device
from model.sampling import RowSampler, SamplingBatch
from model.sampling_params import SamplingParams
from model.tokenizer import vocabulary_tables
from model.transformer import Transformer
from server.messages import (
    EngineConfig,
    ModelFailed,
    ModelInfo,
    failure_message,
    parse_rope_variant,
)


@dataclass
class LoadedModel:
    """A checkpoint ready to decode: the model, its tokenizer and per-vocabulary tables."""

    name: str
    base: str  # the checkpoint it was loaded from (``name`` itself unless a variant)
    model: Transformer
    tokenizer: Tokenizer
    token_bytes: list[bytes]  # id → raw bytes (specials: b"")
    token_strings: list[str]  # id → the token as logprobs name it
    bos: int
    eos: int
    max_context: int
    load_seconds: float

    @property
    def vocab(self) -> int:
        return len(self.token_bytes)

    def info(self) -> ModelInfo:
        config = self.model.config
        return ModelInfo(
            name=self.name,
            base=self.base,
            scheme=config.scheme,
            kind=self.model.positional.kind,
            claim=self.model.positional.claim,
            positional=dict(config.positional),
            context_length=config.context_length,
            max_positions=self.model.positional.max_positions,
            max_context=self.max_context,
            n_layers=config.n_layers,
            n_heads=config.n_heads,
            parameters=self.model.num_parameters(),
            load_seconds=self.load_seconds,
            decode_backend=str(self.model.decode_backend),
            cpu_isa=kernels.active() if self.model.decode_backend == "cpu-kernel" else None,
        )


def prepare(
    name: str,
    base: str,
    model: Transformer,
    tokenizer: Tokenizer,
    max_context: int | None,
    started: float,
) -> LoadedModel:
    return LoadedModel(
        name=name,
        base=base,
        model=model,
        tokenizer=tokenizer,
        **vocabulary_tables(tokenizer)._asdict(),
        max_context=context_limit(model, max_context),
        load_seconds=time.perf_counter() - started,
    )


def context_limit(model: Transformer, configured: int | None) -> int:
    """Most tokens (prompt + completion) one sequence of ``model`` may hold.

    Default: max_positions for the table schemes (``PositionalScheme.is_table``), else 4 ×
    context_length. A configured value replaces the default but never passes a scheme's own
    cap (a table's rows, or 2**bits for binary).
    """
    config, cap = model.config, model.positional.max_positions
    default = config.max_positions if model.positional.is_table else 4 * config.context_length
    limit = configured or default
    return limit if cap is None else min(limit, cap)


def engine_device(name: str) -> torch.device:
    """The device the settings name; a ValueError if it is CUDA and torch sees none."""
    device = resolve_device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but torch sees no CUDA device")
    return device


def load_all(
    config: EngineConfig, announce: Callable[[str], None] | None = None
) -> Iterator[LoadedModel | ModelFailed]:
    """Each configured model in turn, loaded, or why it failed (then its rope variants).
    ``announce(name)`` is called before each checkpoint is read."""
    root = Path(config.checkpoints)
    try:
        device = engine_device(config.device)
    except ValueError as error:
        for name, _ in config.models:
            yield ModelFailed(name, failure_message(error, root))
        return
    for name, folder in config.models:
        if announce is not None:
            announce(name)
        started = time.perf_counter()
        try:
            model, tokenizer = load_checkpoint(folder, device, config.dtype)
            warm_up(model)
            loaded = prepare(name, name, model, tokenizer, config.max_context, started)
        except Exception as error:
            yield ModelFailed(name, failure_message(error, root))
            continue
        yield loaded
        if model.config.scheme == "rope":
            for variant in config.rope_variants:
                yield variant_of(loaded, variant, config.max_context)


def warm_up(model: Transformer) -> None:
    """One tiny forward before the model serves: it builds the C++ kernels its decoding uses
    (``model.kernels``: about half a minute each, once per machine) here, on the loader thread,
    rather than in the first request's step."""
    weights = model.lm_head.weight
    tokens = torch.zeros(1, 2, dtype=torch.long, device=weights.device)
    cache = KVCache(model.config, 1, 3, weights.device, weights.dtype)
    greedy = SamplingBatch([RowSampler(SamplingParams(temperature=0.0))], weights.device)
    tempered = SamplingBatch([RowSampler(SamplingParams(temperature=1.0, seed=0))], weights.device)
    with torch.inference_mode():
        model(tokens, cache)  # a prompt: the projection kernel
        logits = model(tokens[:, :1], cache, last_only=True)  # a cached step: the decode step's
        greedy.sample(logits)  # a greedy draw: the argmax kernel
        tempered.sample(logits)  # a draw at a temperature alone: the draw kernel


def variant_of(base: LoadedModel, variant: str, max_context: int | None) -> LoadedModel:
    """``base`` under a context-extension ``variant`` ("yarn4"), sharing its weights."""
    started = time.perf_counter()
    scaling, factor = parse_rope_variant(variant)
    model = with_positional(base.model, {"scaling": scaling, "scaling_factor": factor})
    return dataclasses.replace(  # the same tokenizer: its tables are the base's, not made again
        base,
        name=f"{base.name}+{variant}",
        model=model,
        max_context=context_limit(model, max_context),
        load_seconds=time.perf_counter() - started,
    )
