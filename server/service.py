"""Which checkpoints are served, loading them, and the per-app state routes read.

A model's name is its checkpoint folder's name. Loading runs in a worker thread after the app
has started, one model after another (the default first), and each model loads — or fails — on
its own: a broken checkpoint makes that model answer 503 with what is wrong, while the others
serve. ``/health`` is 200 while at least one model is ready.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from model.chat import ChatTemplate
from model.checkpoint import CONFIG_FILE, load_checkpoint, with_positional
from model.tokenizer import special_ids, token_bytes
from model.transformer import Transformer
from server.engine import Engine
from server.errors import APIError, busy
from server.metrics import Metrics
from server.settings import Settings, parse_rope_variant

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

    Default: max_positions for the table schemes (``PositionalScheme.is_table``), else 4 ×
    context_length. A configured value replaces the default but never passes a scheme's own
    cap (a table's rows, or 2**bits for binary).
    """
    config, cap = model.config, model.positional.max_positions
    default = config.max_positions if model.positional.is_table else 4 * config.context_length
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
    chat_template: ChatTemplate

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
    return serve_model(name, model, tokenizer, folder, settings, metrics)


def serve_model(
    name: str,
    model: Transformer,
    tokenizer: Tokenizer,
    folder: Path,
    settings: Settings,
    metrics: Metrics,
) -> ServedModel:
    """``model`` ready to serve as ``name``: its engine and per-vocabulary tables."""
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
        chat_template=ChatTemplate.from_checkpoint(folder),
    )


class ModelState(StrEnum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass
class ModelStatus:
    """One model's state as ``/health`` reports it; ``message`` says why it failed."""

    state: ModelState = ModelState.LOADING
    message: str | None = None

    def describe(self) -> dict[str, str]:
        return {"state": self.state, **({"message": self.message} if self.message else {})}


def load_failure(error: Exception, root: Path) -> str:
    """What went wrong loading a model, with paths relative to the checkpoints folder (a
    client has no business knowing where the server keeps its files)."""
    message = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
    for prefix in {str(root.resolve()), str(root)}:
        message = message.replace(prefix.rstrip("/") + "/", "")
    return message


class Service:
    """What the routes need: settings, metrics, each model's status and the ready models."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.models: dict[str, ServedModel] = {}  # the ready models, added as each loads
        self.status: dict[str, ModelStatus] = {}  # every model to serve, ready or not
        self.default_model = ""
        self.load_error: str | None = None  # set when no model could even be looked for

    @property
    def ready(self) -> bool:
        """At least one model serves."""
        return bool(self.models)

    @property
    def settled(self) -> bool:
        """Every model has loaded or failed (or there was nothing to load)."""
        if self.load_error is not None:
            return True
        states = [status.state for status in self.status.values()]
        return bool(states) and ModelState.LOADING not in states

    async def load(self) -> None:
        """Load each model in a worker thread, then start its engine on this loop."""
        settings = self.settings
        try:
            folders = discover_checkpoints(settings.checkpoints, settings.models)
            self.default_model = choose_default(list(folders), settings.default_model)
        except ValueError as error:
            self.load_error = load_failure(error, settings.checkpoints)
            logger.error("no models to serve: %s", self.load_error)
            return
        self.status = {name: ModelStatus() for name in folders}
        # Only the engine threads compute in parallel (each sets its own thread count): an
        # OpenMP team kept by this thread or the loader's slowed a 2-thread engine 3-4x.
        torch.set_num_threads(1)
        loop = asyncio.get_running_loop()
        order = sorted(folders, key=lambda name: name != self.default_model)  # default first
        for name in order:
            await self._load_one(name, folders[name], loop)
        ready = [name for name, status in self.status.items() if status.state == "ready"]
        logger.info("serving %s (default %s)", ready, self.default_model)

    async def _load_one(self, name: str, folder: Path, loop: asyncio.AbstractEventLoop) -> None:
        started = time.perf_counter()

        def load() -> ServedModel:
            torch.set_num_threads(1)
            return load_model(name, folder, self.settings, self.metrics)

        try:
            served = await asyncio.to_thread(load)
        except Exception as error:
            message = load_failure(error, self.settings.checkpoints)
            self.status[name] = ModelStatus(ModelState.FAILED, message)
            logger.error("model '%s' failed to load: %s", name, message)
            return
        self._ready(served, started, loop)
        if served.model.config.scheme == "rope":
            for variant in self.settings.rope_variants:
                self._serve_variant(served, folder, variant, loop)

    def _ready(self, served: ServedModel, started: float, loop: asyncio.AbstractEventLoop) -> None:
        served.engine.start(loop)
        self.models[served.name] = served
        self.status[served.name] = ModelStatus(ModelState.READY)
        logger.info(
            "model '%s' ready: %s %s, %s parameters, loaded in %.1f s",
            served.name,
            served.model.config.scheme,
            served.model.config.positional.get("scaling") or "",
            f"{served.model.num_parameters():,}",
            time.perf_counter() - started,
        )

    def _serve_variant(
        self, base: ServedModel, folder: Path, variant: str, loop: asyncio.AbstractEventLoop
    ) -> None:
        """``base`` under a context-extension ``variant`` ("yarn4"), on the same weights."""
        started, name = time.perf_counter(), f"{base.name}+{variant}"
        scaling, factor = parse_rope_variant(variant)
        overrides = {"scaling": scaling, "scaling_factor": factor}
        model = with_positional(base.model, overrides)
        served = serve_model(name, model, base.tokenizer, folder, self.settings, self.metrics)
        self.status[name] = ModelStatus()
        self._ready(served, started, loop)

    async def close(self) -> None:
        for served in self.models.values():
            await served.engine.close()

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(at least one model ready, the ``/health`` document)."""
        states = {status.state for status in self.status.values()}
        if self.ready:
            overall = "ok" if states == {ModelState.READY} else "degraded"
        else:
            overall = "loading" if ModelState.LOADING in states else "failed"
        models = {name: status.describe() for name, status in self.status.items()}
        return self.ready, {"status": overall, "models": models}

    def get(self, name: str | None) -> ServedModel:
        """The model a request names (None: the default); 503 while it loads or if it failed
        to load, 404 if there is no such model."""
        if self.load_error is not None:
            raise busy(self.load_error, status=503)
        wanted = name or self.default_model
        served = self.models.get(wanted)
        if served is not None:
            return served
        status = self.status.get(wanted)
        if status is None:
            if not self.status:
                raise busy("the models are still loading", status=503)
            raise APIError(
                404,
                f"model {name!r} does not exist; available: {list(self.status)}",
                param="model",
                code="model_not_found",
            )
        if status.state == ModelState.FAILED:
            raise busy(f"model '{wanted}' failed to load: {status.message}", status=503)
        raise busy(f"model '{wanted}' is still loading", status=503)
