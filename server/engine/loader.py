"""Loading the served checkpoints, in the engine process: the only place weights live.

Each model loads, or fails, on its own (the others still serve). Rope checkpoints are also
served under each configured context-extension variant (``rope+yarn4``), on the same weights.
The API process holds only tokenizers and what :class:`~server.messages.ModelInfo` says.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from model.checkpoint import load_checkpoint, with_positional
from model.transformer import Transformer
from server.api.service import context_limit, load_failure, resolve_device, vocabulary_tables
from server.api.settings import parse_rope_variant
from server.messages import EngineConfig, ModelFailed, ModelInfo


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
            positional=dict(config.positional),
            context_length=config.context_length,
            max_positions=self.model.positional.max_positions,
            max_context=self.max_context,
            parameters=self.model.num_parameters(),
            load_seconds=self.load_seconds,
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


def load_all(
    config: EngineConfig, announce: Callable[[str], None] | None = None
) -> Iterator[LoadedModel | ModelFailed]:
    """Each configured model in turn, loaded, or why it failed (then its rope variants).
    ``announce(name)`` is called before each checkpoint is read."""
    device = resolve_device(config.device)
    root = Path(config.checkpoints)
    for name, folder in config.models:
        if announce is not None:
            announce(name)
        started = time.perf_counter()
        try:
            model, tokenizer = load_checkpoint(folder, device, config.dtype)
            loaded = prepare(name, name, model, tokenizer, config.max_context, started)
        except Exception as error:
            yield ModelFailed(name, load_failure(error, root))
            continue
        yield loaded
        if model.config.scheme == "rope":
            for variant in config.rope_variants:
                yield variant_of(loaded, variant, config.max_context)


def variant_of(base: LoadedModel, variant: str, max_context: int | None) -> LoadedModel:
    """``base`` under a context-extension ``variant`` ("yarn4"), sharing its weights."""
    started = time.perf_counter()
    scaling, factor = parse_rope_variant(variant)
    model = with_positional(base.model, {"scaling": scaling, "scaling_factor": factor})
    name = f"{base.name}+{variant}"
    return prepare(name, base.name, model, base.tokenizer, max_context, started)
