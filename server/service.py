"""Which checkpoints are served, loading them, and the per-app state routes read.

A model's name is its checkpoint folder's name. Loading runs in a worker thread after the app
has started, so ``/health`` can answer 503 until every model is loaded and its engine running.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from model.checkpoint import CONFIG_FILE, load_checkpoint
from model.positional import TABLE_SCHEMES
from model.tokenizer import special_ids, token_bytes
from model.transformer import Transformer
from server.engine import Engine
from server.errors import APIError, busy
from server.metrics import Metrics
from server.settings import Settings

logger = logging.getLogger("ordinal.server")

PREFERRED_DEFAULT = "rope"


def discover_checkpoints(folder: Path, names: list[str]) -> dict[str, Path]:
    """Checkpoint folders in ``folder`` by name (all of them, or those in ``names``)."""
    if not folder.is_dir():
        raise ValueError(f"checkpoints folder {str(folder)!r} does not exist")
    found = {
        path.name: path
        for path in sorted(folder.iterdir())
        if not path.name.startswith(".") and (path / CONFIG_FILE).is_file()
    }
    if not found:
        raise ValueError(f"no checkpoints (folders with {CONFIG_FILE}) in {str(folder)!r}")
    unknown = [name for name in names if name not in found]
    if unknown:
        raise ValueError(f"models {unknown} are not in {str(folder)!r}; found {list(found)}")
    return {name: found[name] for name in names} if names else found


def choose_default(names: list[str], requested: str | None) -> str:
    """The model a request without ``model`` gets: ``requested``, else rope, else the first."""
    if requested is not None:
        if requested not in names:
            raise ValueError(f"default_model {requested!r} is not among the models {names}")
        return requested
    return PREFERRED_DEFAULT if PREFERRED_DEFAULT in names else names[0]


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def check_settings(settings: Settings) -> None:
    """Raise ValueError now for what would otherwise fail only once loading starts."""
    names = list(discover_checkpoints(settings.checkpoints, settings.models))
    choose_default(names, settings.default_model)
    resolve_device(settings.device)


def context_limit(model: Transformer, configured: int | None) -> int:
    """Most tokens (prompt + completion) one sequence of ``model`` may hold.

    Default: max_positions for the table schemes (learned, mds, lowrank), else 4 ×
    context_length. A configured value replaces the default but never passes a scheme's own
    cap (a table's rows, or 2**bits for binary).
    """
    config, cap = model.config, model.positional.max_positions
    default = config.max_positions if config.scheme in TABLE_SCHEMES else 4 * config.context_length
    limit = configured or default
    return limit if cap is None else min(limit, cap)


@dataclass
class ServedModel:
    """A loaded checkpoint, its engine, and per-vocabulary tables computed once."""

    name: str
    model: Transformer
    tokenizer: Tokenizer
    engine: Engine
    max_context: int
    token_bytes: list[bytes]  # id → raw bytes (specials: b"")
    token_strings: list[str]  # id → the token as logprobs name it (specials by name)
    bos: int
    eos: int
    created: int

    @property
    def vocab(self) -> int:
        return len(self.token_bytes)

    def describe(self) -> dict[str, Any]:
        """The model's entry in ``GET /v1/models``."""
        config = self.model.config
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "ordinal",
            "scheme": config.scheme,
            "positional": config.positional,
            "context_length": config.context_length,
            "max_positions": self.model.positional.max_positions,  # None: no table, no cap
            "max_context": self.max_context,
            "parameters": self.model.num_parameters(),
        }


def load_model(name: str, folder: Path, settings: Settings, metrics: Metrics) -> ServedModel:
    device = resolve_device(settings.device)
    model, tokenizer = load_checkpoint(folder, device, settings.dtype)
    specials = special_ids(tokenizer)
    table = token_bytes(tokenizer)
    strings = [piece.decode("utf-8", errors="backslashreplace") for piece in table]
    for special in specials:
        strings[special] = tokenizer.id_to_token(special)
    max_context = context_limit(model, settings.max_context)
    engine = Engine(
        name,
        model,
        vocab=len(table),
        filler=specials.bos,
        max_batch_size=settings.max_batch_size,
        max_context=max_context,
        max_queue=settings.max_queue,
        metrics=metrics.for_model(name),
        stream_interval=settings.stream_interval,
        threads=settings.threads,
    )
    return ServedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        engine=engine,
        max_context=max_context,
        token_bytes=table,
        token_strings=strings,
        bos=specials.bos,
        eos=specials.eos,
        created=int(folder.stat().st_mtime),
    )


class Service:
    """What the routes need: settings, metrics and, once loaded, the models."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.models: dict[str, ServedModel] = {}  # empty until every model is loaded
        self.default_model = ""
        self.load_error: str | None = None

    @property
    def ready(self) -> bool:
        return bool(self.models)

    async def load(self) -> None:
        """Load every model in a worker thread, then start their engines on this loop."""
        settings = self.settings
        try:
            folders = discover_checkpoints(settings.checkpoints, settings.models)
            self.default_model = choose_default(list(folders), settings.default_model)
            # Only the engine threads compute in parallel (each sets its own thread count): an
            # OpenMP team kept by this thread or the loader's slowed a 2-thread engine 3-4x.
            torch.set_num_threads(1)

            def load_all() -> dict[str, ServedModel]:
                torch.set_num_threads(1)
                return {
                    name: load_model(name, folder, settings, self.metrics)
                    for name, folder in folders.items()
                }

            models = await asyncio.to_thread(load_all)
        except Exception as error:
            self.load_error = f"{type(error).__name__}: {error}"
            logger.exception("loading the models failed")
            return
        loop = asyncio.get_running_loop()
        for served in models.values():
            served.engine.start(loop)
        self.models = models
        logger.info("serving %s (default %s)", list(models), self.default_model)

    async def close(self) -> None:
        for served in self.models.values():
            await served.engine.close()

    def get(self, name: str | None) -> ServedModel:
        """The model a request names (None: the default); 503 while loading, 404 if unknown."""
        if not self.ready:
            raise busy(self.load_error or "the models are still loading", status=503)
        served = self.models.get(name or self.default_model)
        if served is None:
            raise APIError(
                404,
                f"model {name!r} does not exist; available: {list(self.models)}",
                param="model",
                code="model_not_found",
            )
        return served
