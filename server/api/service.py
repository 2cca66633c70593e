"""Which checkpoints are served, and the per-app state routes read.

A model's name is its checkpoint folder's name. The engine process (``server.engine.core``) loads
them after the app has started, one model after another (the default first), and each model loads
— or fails — on its own: a broken checkpoint makes that model answer 503 with what is wrong,
while the others serve. ``/health`` is 200 while at least one model is ready.

While it serves, the folder is watched (``--watch-interval``; ``POST /v1/models/reload`` looks
at once): a checkpoint folder that appears, or whose files change, is loaded once its files have
stopped changing for one look, and answers on ``/v1/models`` as soon as it has loaded (a
replaced model's streams end on the weights they began with; new requests get the new ones). A
folder that is removed is unloaded the same way. One that is incomplete once still (a copy that
stopped half-way) or fails to load (corrupt weights) is reported in ``/health`` and the log and
never served (a served model keeps its weights); it is tried again when its files change.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

import model.cpu as cpu
from model.chat import ChatTemplate
from model.files import CONFIG_FILE, MODEL_FILES, TOKENIZER_FILE
from model.tokenizer import load_tokenizer, special_ids, vocabulary_tables
from server.api.client import EngineClient, Launcher, ModelClient
from server.api.errors import APIError, busy
from server.api.metrics import Metrics
from server.api.offload import most_prompt_bytes
from server.api.priority import PriorityScopes
from server.api.settings import Settings
from server.messages import EngineConfig, ModelInfo, failure_message

if TYPE_CHECKING:  # server.api.tracing reads the writers, which read this module
    from server.api.tracing import Tracing

logger = logging.getLogger("ordinal.server")

PREFERRED_DEFAULT = "rope"
RELOAD_TIMEOUT = 60.0  # seconds ``POST /v1/models/reload`` waits for the loads it started


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


# What a look at a checkpoint folder sees: each file's name, size and modification time.
FolderState = tuple[tuple[str, int, int], ...]
_UNSEEN = ()  # a folder not seen changing (no folder state is empty: it holds a model file)


def folder_states(folder: Path) -> dict[str, FolderState]:
    """The state of each folder in ``folder`` that holds any of a checkpoint's files, by name
    (hidden folders left out): what the watcher compares between two looks."""
    states = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or not path.is_dir():
            continue
        files = []
        for file in sorted(path.iterdir()):
            with contextlib.suppress(OSError):  # removed between the listing and the stat
                stat = file.stat()
                files.append((file.name, stat.st_size, stat.st_mtime_ns))
        if any(name in MODEL_FILES for name, _, _ in files):
            states[path.name] = tuple(files)
    return states


def choose_default(names: list[str], requested: str | None) -> str:
    """The model a request without ``model`` gets: ``requested``, else rope, else the first."""
    if requested is not None:
        if requested not in names:
            raise ValueError(f"default_model {requested!r} is not among the models {names}")
        return requested
    return PREFERRED_DEFAULT if PREFERRED_DEFAULT in names else names[0]


def check_settings(settings: Settings) -> None:
    """Raise ValueError now for what would otherwise fail only once loading starts: the models,
    and a kernel variant (ORDINAL_CPU_ISA) this CPU cannot run (model.cpu)."""
    names = list(discover_checkpoints(settings.checkpoints, settings.models))
    choose_default(names, settings.default_model)
    cpu.chosen()


@dataclass
class ServedModel:
    """A model the engine process has loaded, as the API process knows it: its tokenizer and
    per-vocabulary tables (computed once), what the engine said of it, and its engine."""

    name: str
    info: ModelInfo
    tokenizer: Tokenizer
    engine: ModelClient
    token_bytes: list[bytes]  # id → raw bytes (specials: b"")
    token_strings: list[str]  # id → the token as logprobs name it (specials by name)
    bos: int
    eos: int
    created: int
    chat_template: ChatTemplate

    @classmethod
    def from_checkpoint(cls, info: ModelInfo, folder: Path, engine: ModelClient) -> ServedModel:
        tokenizer = load_tokenizer(folder / TOKENIZER_FILE)
        return cls(
            name=info.name,
            info=info,
            tokenizer=tokenizer,
            engine=engine,
            **vocabulary_tables(tokenizer)._asdict(),
            created=int(folder.stat().st_mtime),
            chat_template=ChatTemplate.from_checkpoint(folder),
        )

    @property
    def vocab(self) -> int:
        return len(self.token_bytes)

    @property
    def max_context(self) -> int:
        return self.info.max_context

    @functools.cached_property
    def max_prompt_bytes(self) -> int:
        """The longest prompt text (UTF-8) that could fit the context; longer is refused
        before it is tokenised."""
        specials = [self.token_strings[token] for token in special_ids(self.tokenizer)]
        return most_prompt_bytes(self.max_context, self.token_bytes, specials)

    @functools.cached_property
    def special_names(self) -> dict[str, int]:
        """Each special token's name → its id: the bos, eos and pad tokens, and any other the
        tokenizer marks special."""
        added = self.tokenizer.get_added_tokens_decoder()
        names = {token.content: id_ for id_, token in added.items() if token.special}
        return names | {self.token_strings[id_]: id_ for id_ in special_ids(self.tokenizer)}

    def describe(self) -> dict[str, Any]:
        """The model's entry in ``GET /v1/models``."""
        info = self.info
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "ordinal",
            "scheme": info.scheme,
            "kind": info.kind,  # how the scheme tells positions apart: added, rotation, ...
            "claim": info.claim,  # what it predicts one should see (the playground's note)
            "positional": info.positional,
            "context_length": info.context_length,
            "max_positions": info.max_positions,  # None: no table, no cap
            "max_context": info.max_context,
            "parameters": info.parameters,
            "decode_backend": info.decode_backend,  # model.backend: which code decodes it
            "cpu_isa": info.cpu_isa,  # the kernel variant, on the cpu-kernel backend
            "speculative": info.speculative,  # --speculative as this model decodes it
        }


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


class Service:
    """What the routes need: settings, metrics, each model's status and the ready models.

    The models live in the engine process (``server.api.client``): this process learns of each
    as it loads or fails, and marks them all loading again while a crashed engine restarts.
    """

    def __init__(self, settings: Settings, launcher: Launcher | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.priorities = PriorityScopes(settings)  # who may claim which priority
        self.models: dict[str, ServedModel] = {}  # the ready models, added as each loads
        self.status: dict[str, ModelStatus] = {}  # every model to serve, ready or not
        self.default_model = ""
        self.load_error: str | None = None  # set when no model could even be looked for
        self.engine: EngineClient | None = None
        self._launcher = launcher
        self._folders: dict[str, Path] = {}
        # The watcher's view: each folder's state when it was last acted on, the state seen at
        # the last look of a folder that is changing, and the folders reported incomplete.
        self._acted_on: dict[str, FolderState] = {}
        self._changing: dict[str, FolderState | None] = {}
        self._incomplete: set[str] = set()
        self._watcher: asyncio.Task[None] | None = None
        self._outcomes: Counter[str] = Counter()  # loads ended (loaded or failed), by model
        self.tracing: Tracing | None = None  # with --otlp-traces-endpoint (create_app sets it)

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
        """Start the engine process, which loads every model (the default first)."""
        settings = self.settings
        try:
            folders = discover_checkpoints(settings.checkpoints, settings.models)
            self.default_model = choose_default(list(folders), settings.default_model)
        except ValueError as error:
            self.load_error = failure_message(error, settings.checkpoints)
            logger.error("no models to serve: %s", self.load_error)
            return
        self._folders = folders
        self.status = {name: ModelStatus() for name in folders}
        order = sorted(folders, key=lambda name: name != self.default_model)  # default first
        config = EngineConfig(
            models=[(name, str(folders[name])) for name in order],
            checkpoints=str(settings.checkpoints),
            device=settings.device,
            dtype=settings.dtype,
            threads=settings.threads,
            max_batch_size=settings.max_batch_size,
            max_context=settings.max_context,
            prefill_chunk=settings.prefill_chunk,
            stream_interval=settings.stream_interval,
            rope_variants=settings.rope_variants,
            prefix_cache_tokens=settings.prefix_cache_tokens,
            cuda_graphs=settings.cuda_graphs,
            attention_helper=settings.attention_helper,
            priority_aging=settings.priority_aging,
            speculative=None if settings.speculative == "off" else settings.speculative,
            num_speculative_tokens=settings.num_speculative_tokens,
            prompt_lookup_max=settings.prompt_lookup_max,
            prompt_lookup_min=settings.prompt_lookup_min,
        )
        capacity = settings.max_batch_size + settings.max_queue
        self.engine = EngineClient(
            config,
            self.metrics,
            self,
            capacity=capacity,
            launcher=self._launcher,
            stall_timeout=settings.engine_stall_timeout,
            max_traces=settings.max_traces,
        )
        await self.engine.start()
        self._acted_on = await asyncio.to_thread(self._folder_states)
        if settings.watch_interval > 0:
            self._watcher = asyncio.create_task(self._watch(settings.watch_interval))

    def _folder_states(self) -> dict[str, FolderState]:
        """The checkpoint folders served or to be served: every one, or ``--models``'."""
        states = folder_states(self.settings.checkpoints)
        named = self.settings.models
        return {name: state for name, state in states.items() if not named or name in named}

    async def _watch(self, interval: float) -> None:
        """Look at the checkpoints folder every ``interval`` seconds (the module's docstring)."""
        while True:
            await asyncio.sleep(interval)
            await self.look(settle=True)

    async def look(self, settle: bool) -> dict[str, list[str]]:
        """One look at the checkpoints folder: act on each folder whose files have changed, or
        that is gone, since it was last acted on; with ``settle``, only once it has not changed
        for one look (a copy may be under way). Returns the names it acted on by what it did:
        ``loading`` (new, changed or failed before), ``reported`` (incomplete), ``unloaded``."""
        acted: dict[str, list[str]] = {"loading": [], "reported": [], "unloaded": []}
        try:
            states = await asyncio.to_thread(self._folder_states)
        except OSError as error:  # the folder itself went away: leave everything as it is
            logger.warning("cannot look at the checkpoints folder: %s", error)
            return acted
        assert self.engine is not None
        for name in [*states, *(set(self._acted_on) - set(states))]:
            state = states.get(name)  # None: the folder is gone
            if self._acted_on.get(name) == state or name in self.engine.crashed:
                continue
            if (status := self.status.get(name)) and status.state == ModelState.LOADING:
                continue  # acted on when this load has ended
            if settle and self._changing.get(name, _UNSEEN) != state:
                self._changing[name] = state  # changed since the last look: let it settle
                continue
            self._changing.pop(name, None)
            acted[self._act(name, state)].append(name)
        return acted

    async def reload(self) -> dict[str, Any]:
        """``POST /v1/models/reload``: one look that acts at once on every change, and what
        became of it once the loads it started have ended (``RELOAD_TIMEOUT`` at most)."""
        before = self._outcomes.copy()
        acted = await self.look(settle=False)
        deadline = time.monotonic() + RELOAD_TIMEOUT
        loading = acted["loading"]
        while time.monotonic() < deadline and any(
            self._outcomes[name] == before[name] for name in loading
        ):
            await asyncio.sleep(0.02)
        failed = {
            name: status.message
            for name in [*loading, *acted["reported"]]
            if (status := self.status.get(name)) is not None and status.message is not None
        }
        ended = [name for name in loading if self._outcomes[name] != before[name]]
        return {
            "loaded": [name for name in ended if name not in failed],
            "failed": failed,
            "still_loading": [name for name in loading if name not in ended],
            "unloaded": acted["unloaded"],
            "models": list(self.models),
        }

    def _act(self, name: str, state: FolderState | None) -> str:
        """Unload, report or load checkpoint folder ``name`` as ``state`` finds it."""
        assert self.engine is not None
        if state is None:
            self._acted_on.pop(name, None)
            self._unload(name)
            return "unloaded"
        self._acted_on[name] = state
        folder = self.settings.checkpoints / name
        missing = [file for file in MODEL_FILES if not (folder / file).is_file()]
        if missing:
            self._incomplete.add(name)
            self.failed(
                name,
                f"incomplete checkpoint folder: no {', '.join(missing)}; it is tried again "
                "when its files change",
            )
            return "reported"
        self._incomplete.discard(name)
        served = name in self.models
        logger.info("checkpoint '%s' %s: loading it", name, "changed" if served else "found")
        self._folders[name] = folder
        if not served:  # a served model answers from the weights it has until the new load
            self.status[name] = ModelStatus()
        self.engine.load(name, str(folder))
        return "loading"

    def _unload(self, name: str) -> None:
        """Stop serving checkpoint ``name`` and its rope variants: requests naming them get a
        404 from now on, and the streams they have finish first in the engine."""
        assert self.engine is not None
        gone = [served for served, model in self.models.items() if model.info.base == name]
        for served in {name, *gone}:
            self.models.pop(served, None)
            self.status.pop(served, None)
        self._folders.pop(name, None)
        self._incomplete.discard(name)
        logger.info("checkpoint '%s' was removed: no longer served", name)
        self.engine.unload(name)

    # ---- what the engine process reports (server.api.client.Listener) -------------------------

    def loaded(self, info: ModelInfo, engine: ModelClient) -> None:
        # This process reads the files the engine does not (tokenizer, chat template): one that
        # is broken fails its model here, as the engine fails one whose weights are broken.
        # Raised into the engine client, it would be taken for a lost engine and restart it.
        try:
            served = ServedModel.from_checkpoint(info, self._folders[info.base], engine)
        except Exception as error:
            self.failed(info.name, failure_message(error, self.settings.checkpoints))
            return
        self.models[info.name] = served
        self.status[info.name] = ModelStatus(ModelState.READY)
        self._outcomes[info.name] += 1
        backend = info.decode_backend + (f" ({info.cpu_isa})" if info.cpu_isa else "")
        logger.info(
            "model '%s' ready: %s %s, %s parameters, decoded by %s, loaded in %.1f s",
            info.name,
            info.scheme,
            info.positional.get("scaling") or "",
            f"{info.parameters:,}",
            backend,
            info.load_seconds,
        )
        if self.settled:
            logger.info("serving %s (default %s)", list(self.models), self.default_model)

    def failed(self, name: str, message: str) -> None:
        """Model ``name`` failed to load; one that serves (its folder changed and the new files
        failed) goes on serving the weights it loaded before, and says so."""
        if name in self.models:
            message += "; the weights loaded before still serve"
            self.status[name] = ModelStatus(ModelState.READY, message)
        else:
            self.status[name] = ModelStatus(ModelState.FAILED, message)
        self._outcomes[name] += 1
        logger.error("model '%s' failed to load: %s", name, message)

    def lost(self) -> None:
        """The engine process died: nothing serves until its successor has loaded."""
        self.models.clear()
        for name in self.status:
            if name not in self._incomplete:  # those the engine never had stay as they are
                self.status[name] = ModelStatus(ModelState.LOADING, "the engine is restarting")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self.engine is not None:
            await self.engine.close()
        if self.tracing is not None:
            self.tracing.shutdown()

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(at least one model ready and the engine stepping, the ``/health`` document)."""
        states = {status.state for status in self.status.values()}
        models = {name: status.describe() for name, status in self.status.items()}
        if self.engine is not None and self.engine.stalled:
            return False, {"status": "stalled", "models": models}
        if self.ready:
            overall = "ok" if states == {ModelState.READY} else "degraded"
        else:
            overall = "loading" if ModelState.LOADING in states else "failed"
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
                f"model {wanted!r} does not exist; available: {list(self.status)}",
                param="model",
                code="model_not_found",
            )
        if status.state == ModelState.FAILED:
            raise busy(f"model '{wanted}' failed to load: {status.message}", status=503)
        why = f" ({status.message})" if status.message else ""
        raise busy(f"model '{wanted}' is still loading{why}", status=503)
