"""The API process's side of the engine process: starting it, talking to it, restarting it.

:class:`EngineClient` starts the engine process (``server.engine.core``; multiprocessing's
*spawn*, so the child shares nothing with this process but a socket), sends it the
configuration, then jobs and cancellations, and reads its frames on the event loop: each job's
events go to the job's queue, each model's stats to the Prometheus metrics served here
(``/metrics``).

**If the engine process dies** (its socket closes without a ``Shutdown``): every job in flight
ends at once with a 503 error event, every model is marked loading (so requests get a 503 and
``/health`` a 503 while no model serves), and a new engine process is started after
``RESTART_DELAY`` seconds, doubled after each crash that follows within ``STABLE_AFTER``
seconds of a start (at most ``MAX_RESTART_DELAY``). It reloads every model; each answers
again as soon as it is loaded.

**Shutdown** (:meth:`EngineClient.close`): a ``Shutdown`` message; the engine fails what is
left with a 503 ("shutting down"), sends it, and exits. The API process waits up to
``STOP_TIMEOUT`` seconds in all for its last frames and for it to exit, then kills it. With
nothing in flight there is nothing to wait for: ``IDLE_STOP_TIMEOUT``, whatever the engine is
doing (loading, stopped, starting, or not there during a restart's backoff, which ends at once),
so SIGTERM ends an idle server within 2 s (``docker stop`` kills at 10).

**If the engine stops stepping** (stopped, deadlocked, stuck in native code): every step sends
its stats, at least every ``stream_interval``, so while work waits its frames are the engine's
heartbeat. :attr:`EngineClient.stalled` is true once none has come for ``stall_timeout`` seconds
while a job or trace waits (``/health`` then answers 503), and the supervisor kills the process,
which restarts it as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import multiprocessing
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from server.api.errors import APIError, busy
from server.api.job import Event, Failure, Job
from server.api.metrics import ENGINE_LOST, Metrics, ModelMetrics
from server.messages import (
    HEADER,
    Call,
    Cancel,
    Dropped,
    EngineConfig,
    Failed,
    FromEngine,
    Load,
    ModelFailed,
    ModelInfo,
    ModelLoaded,
    ModelLoading,
    Outputs,
    Returned,
    Shutdown,
    Unload,
    frame,
)

logger = logging.getLogger("ordinal.server")

RESTART_DELAY, MAX_RESTART_DELAY, STABLE_AFTER = 0.5, 30.0, 60.0
STOP_TIMEOUT = 30.0  # for the engine to send what is in flight and exit
IDLE_STOP_TIMEOUT = 1.0  # the same with nothing in flight: it has nothing to finish
ENGINE_DIED = "the engine process stopped unexpectedly; it is restarting"


def _engine_main(target: str, sock: socket.socket, *args: Any) -> None:
    """Runs in the new process: import ``target`` ("module:function") and call it."""
    module, function = target.split(":")
    getattr(importlib.import_module(module), function)(sock, *args)


@dataclass(frozen=True)
class Launcher:
    """What the engine process runs: ``target(sock, *args)`` (the tests add a control pipe).

    ``method`` is multiprocessing's start method. The server uses *spawn*: a fresh interpreter
    that imports torch itself (seconds), and no other process holding torch. The tests use
    *forkserver* with ``preload``: one process imports torch once per test session, and each
    engine forks from it in milliseconds.
    """

    target: str = "server.engine.core:run_engine_process"
    args: tuple[Any, ...] = field(default_factory=tuple)
    method: str = "spawn"
    preload: tuple[str, ...] = ()


class Listener(Protocol):
    """What the service learns from the engine."""

    def loaded(self, info: ModelInfo, engine: ModelClient) -> None: ...

    def failed(self, name: str, message: str) -> None: ...

    def lost(self) -> None: ...


class ModelClient:
    """One model's engine as the routes see it (``ServedModel.engine``): submit, cancel, call."""

    def __init__(self, name: str, client: EngineClient, capacity: int, max_traces: int) -> None:
        self.name = name
        self.client = client
        self.metrics: ModelMetrics = client.metrics.for_model(name)
        self.capacity = capacity  # jobs in the engine: decoding or waiting
        self.max_traces = max_traces  # traces in the engine: running or queued
        self.tracing = 0  # of those, in flight now
        self.in_flight = 0  # jobs submitted whose last event has not arrived
        self.closing = 0  # of those, cancelled here and not yet dropped by the engine

    def submit(self, job: Job) -> None:
        """Send ``job`` to the engine; a 429 APIError (Retry-After) when the model is full, a
        503 while the engine is down or stopping."""
        self._admit(self.in_flight, self.capacity, "requests running or queued", "is at capacity")
        self.in_flight += 1
        self.client.submit(self, job)

    def _admit(self, in_use: int, most: int, what: str, state: str) -> None:
        """A 503 while the engine is down or stopping; a 429 APIError (Retry-After) when
        ``in_use`` has reached ``most`` (jobs, or traces: each has its own bound)."""
        self.client.check_up()
        if in_use >= most:
            raise busy(f"model '{self.name}' {state} ({most} {what}, its most); retry shortly")

    def cancel(self, job: Job) -> None:
        """Stop ``job`` and free its row before the engine's next step (no-op once it ended)."""
        if job.closed:
            return
        job.closed = True
        if job.id is not None and self.client.cancel(job.id):
            self.closing += 1

    async def call(self, method: str, args: dict[str, Any]) -> bytes:
        """The JSON the engine function ``method`` (``server.engine.calls``) returns for
        ``args``, its keyword arguments (MessagePack-encodable); a 429 APIError (Retry-After)
        while ``max_traces`` calls of this model (traces, embeddings, patches) are in the
        engine."""
        return (await self.calls(method, [args]))[0]

    async def calls(self, method: str, each: list[dict[str, Any]]) -> list[bytes]:
        """``call`` for each arguments of ``each`` in turn, admitted once as one call: the
        engine runs one a turn of its loop, so streams decode between them."""
        self._admit(
            self.tracing,
            self.max_traces,
            "traces, embeddings or patches running or queued",
            "is busy",
        )
        self.tracing += 1
        try:
            return [await self.client.call(self.name, method, args) for args in each]
        finally:
            self.tracing -= 1


class EngineClient:
    """The engine process, supervised: one for every model the server loads."""

    def __init__(
        self,
        config: EngineConfig,
        metrics: Metrics,
        listener: Listener,
        *,
        capacity: int,
        launcher: Launcher | None = None,
        stall_timeout: float = 10.0,
        max_traces: int = 4,
    ) -> None:
        self.config = config
        self.stall_timeout = stall_timeout
        self.last_heard = time.monotonic()  # the last frame from the engine process
        self._waiting_since: float | None = None  # since when jobs or traces have been waiting
        self.metrics = metrics
        self.listener = listener
        self.launcher = launcher or Launcher()
        self.capacity = capacity  # per model: jobs decoding or waiting
        self.max_traces = max_traces  # per model: traces running or queued
        self.models: dict[str, ModelClient] = {}
        self.process: multiprocessing.process.BaseProcess | None = None
        self.exitcode: int | None = None  # the last engine process's, once it has exited
        self._jobs: dict[int, tuple[ModelClient, Job]] = {}  # jobs in flight, by id
        self._cancelled: set[int] = set()  # of those, the ones whose Cancel was sent
        self._calls: dict[int, asyncio.Future[bytes]] = {}
        self._ids = 0
        self._writer: asyncio.StreamWriter | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = False
        self._stopped = asyncio.Event()  # set by close: ends a restart's backoff at once
        self._starting: asyncio.Future[None] | None = None  # the engine process's start
        self._decoder = msgspec.msgpack.Decoder(FromEngine)
        self._loading: str | None = None  # the checkpoint the engine is reading now
        self.crashed: dict[str, str] = {}  # checkpoints that killed an engine: not loaded again

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    async def start(self) -> None:
        self._supervisor = asyncio.create_task(self._supervise())

    @property
    def stalled(self) -> bool:
        """Work has waited ``stall_timeout`` s without a frame from the engine process."""
        if not (self._jobs or self._calls) or self._waiting_since is None:
            return False
        quiet = time.monotonic() - max(self.last_heard, self._waiting_since)
        return quiet > self.stall_timeout

    def _work_added(self) -> None:
        if self._waiting_since is None or not (self._jobs or self._calls):
            self._waiting_since = time.monotonic()

    def check_up(self) -> None:
        if self._stopping:
            raise busy("the server is shutting down", status=503)
        if self._writer is None:
            raise busy("the engine is restarting", status=503)

    def submit(self, model: ModelClient, job: Job) -> None:
        self._work_added()
        job.id = self._next_id()
        self._jobs[job.id] = (model, job)
        self._send(job.message(job.id, model.name))

    def cancel(self, job_id: int) -> bool:
        """Ask the engine to drop ``job_id``; False if it has already ended, or the engine is
        stopping (it fails every job itself) or gone (its jobs have failed already)."""
        if job_id not in self._jobs or self._stopping or self._writer is None:
            return False
        self._send(Cancel(job_id))
        self._cancelled.add(job_id)
        return True

    async def call(self, model: str, method: str, args: dict[str, Any]) -> bytes:
        self.check_up()
        self._work_added()
        call_id = self._next_id()
        future = self._calls[call_id] = asyncio.get_running_loop().create_future()
        self._send(Call(call_id, model, method, args))
        return await future

    def load(self, name: str, folder: str) -> None:
        """Load checkpoint ``folder`` as model ``name`` beside the others (it answers through
        the listener, as the configured ones do); a restarted engine loads it again."""
        if all(model != name for model, _ in self.config.models):
            models = [*self.config.models, (name, folder)]
            self.config = msgspec.structs.replace(self.config, models=models)
        if self._writer is not None and not self._stopping:  # else the next engine loads it
            self._send(Load(name, folder))

    def unload(self, name: str) -> None:
        """Stop serving checkpoint ``name`` (and its variants); a restarted engine leaves it."""
        models = [(model, folder) for model, folder in self.config.models if model != name]
        self.config = msgspec.structs.replace(self.config, models=models)
        self.models = {key: model for key, model in self.models.items() if key != name}
        if self._writer is not None and not self._stopping:
            self._send(Unload(name))

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    def _send(self, message: msgspec.Struct) -> None:
        self.check_up()
        assert self._writer is not None
        self._writer.write(frame(message))

    async def close(self) -> None:
        """Stop the engine: what is left gets a 503 (sent by the engine), then it exits. Waits
        ``STOP_TIMEOUT`` at most for that, ``IDLE_STOP_TIMEOUT`` when nothing is in flight;
        then the process is killed."""
        if self._stopping:
            return
        writer, self._stopping = self._writer, True
        self._stopped.set()
        grace = STOP_TIMEOUT if self._jobs or self._calls else IDLE_STOP_TIMEOUT
        deadline = time.monotonic() + grace
        if writer is not None:
            with contextlib.suppress(ConnectionError):
                writer.write(frame(Shutdown()))
        if self._supervisor is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._supervisor), grace)
            self._supervisor.cancel()
        await self._reap(max(0.0, deadline - time.monotonic()))  # its socket is closed

    # ---- the engine process's life -------------------------------------------------------

    async def _supervise(self) -> None:
        """Run the engine process; start a new one whenever it dies, until the server stops."""
        delay = RESTART_DELAY
        while not self._stopping:
            started = time.monotonic()
            watchdog = asyncio.create_task(self._watch())
            try:
                await self._serve_one()
            except Exception:
                logger.exception("the engine process failed")
            finally:
                watchdog.cancel()
            if self._stopping:
                return
            self._lost()
            await self._reap(5.0)
            self._blame_loading()
            if time.monotonic() - started >= STABLE_AFTER:
                delay = RESTART_DELAY
            logger.error("the engine process stopped; restarting it in %.1f s", delay)
            with contextlib.suppress(asyncio.TimeoutError):  # close() ends the wait at once
                await asyncio.wait_for(self._stopped.wait(), delay)
            delay = min(2 * delay, MAX_RESTART_DELAY)

    async def _watch(self) -> None:
        """Kill the engine process once it has stalled: its socket closes, and it restarts."""
        while True:
            await asyncio.sleep(min(0.25, self.stall_timeout / 4))
            if self.stalled and self.process is not None and self.process.is_alive():
                logger.error(
                    "the engine process has not stepped for %.1f s while work waits: killing it",
                    self.stall_timeout,
                )
                self.process.kill()
                return

    async def _serve_one(self) -> None:
        """Start an engine process and read it until its socket closes."""
        ours, theirs = socket.socketpair()
        launcher = self.launcher
        context = multiprocessing.get_context(launcher.method)
        if launcher.preload:
            context.set_forkserver_preload(list(launcher.preload))
        # Every start method's context has Process; typeshed types get_context(str) as the
        # BaseContext, which lacks it.
        self.process = context.Process(  # type: ignore[attr-defined]
            target=_engine_main,
            args=(launcher.target, theirs, *launcher.args),
            name="ordinal-engine",
            daemon=True,
        )
        # Off the loop: a fork server starting (the tests') imports torch first. Shielded: a
        # close meanwhile cancels this task, not the start, which _reap waits for.
        self._starting = asyncio.ensure_future(asyncio.to_thread(self.process.start))
        await asyncio.shield(self._starting)
        theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        self._writer = writer
        self.last_heard = time.monotonic()
        writer.write(frame(self._config_now()))
        try:
            await self._read(reader)
        finally:
            self._writer = None
            writer.close()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                (length,) = HEADER.unpack(await reader.readexactly(HEADER.size))
                payload = await reader.readexactly(length)
                self.last_heard = time.monotonic()
                self._dispatch(self._decoder.decode(payload))

    async def _reap(self, timeout: float) -> None:
        """Wait for the engine process to exit; kill it if it has not within ``timeout`` s."""
        process = self.process
        if process is None:
            return
        if self._starting is not None:  # a process can be joined or killed once started
            with contextlib.suppress(Exception):  # a start that failed: _supervise logs it
                await self._starting
        if process.pid is None:  # never started
            self.process = None
            return
        await asyncio.to_thread(process.join, timeout)
        if process.is_alive():
            logger.error("the engine process did not exit: killing it")
            process.kill()
            await asyncio.to_thread(process.join, 5)
        self.exitcode = process.exitcode
        process.close()
        self.process = None

    def _blame_loading(self) -> None:
        """The checkpoint the dead engine was reading killed it (out of memory, a crash in
        native code): it fails, and the next engine does not load it."""
        name, self._loading = self._loading, None
        if name is None:
            return
        self.crashed[name] = (
            f"the engine process died while loading it (exit code {self.exitcode}); it is not "
            "loaded again until the server restarts"
        )
        logger.error("model '%s' %s", name, self.crashed[name])
        self.listener.failed(name, self.crashed[name])

    def _config_now(self) -> EngineConfig:
        """The configuration, without the checkpoints that killed an engine."""
        models = [(name, folder) for name, folder in self.config.models if name not in self.crashed]
        return msgspec.structs.replace(self.config, models=models)

    def _lost(self) -> None:
        """The engine died: every job and call in flight fails (503), every model is down."""
        error = APIError(503, ENGINE_DIED, code="engine_restarting")
        for model, job in self._jobs.values():
            model.metrics.failures[ENGINE_LOST].inc()
            model.in_flight, model.closing = 0, 0
            job.events.put_nowait(Failure(error))
        self._jobs.clear()
        self._cancelled.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        self.models.clear()
        self.listener.lost()
        for name, message in self.crashed.items():  # these stay failed
            self.listener.failed(name, message)

    # ---- what the engine says ------------------------------------------------------------

    def _dispatch(self, message: FromEngine) -> None:
        if isinstance(message, Outputs):
            self._outputs(message)
        elif isinstance(message, ModelLoading):
            self._loading = message.name
        elif isinstance(message, ModelLoaded):
            name = message.info.name
            if name == self._loading:
                self._loading = None
            engine = self.models[name] = ModelClient(name, self, self.capacity, self.max_traces)
            self.listener.loaded(message.info, engine)
        elif isinstance(message, ModelFailed):
            if message.name == self._loading:
                self._loading = None
            self.listener.failed(message.name, message.message)
        elif isinstance(message, Returned):
            self._answer_call(message.id, message.body)

    def _outputs(self, outputs: Outputs) -> None:
        for stats in outputs.stats:
            self.metrics.for_model(stats.model).record(stats)
        for event in outputs.events:
            entry = self._jobs.get(event.id)
            if entry is None:  # not a job: a call that failed
                if isinstance(event, Failed):
                    self._answer_call(event.id, APIError(event.status, event.message))
                continue
            model, job = entry
            if isinstance(event, Dropped):
                last = True
            else:
                delivered: Event
                if isinstance(event, Failed):
                    delivered = Failure(APIError(event.status, event.message, code=event.code))
                else:
                    delivered = event
                job.events.put_nowait(delivered)
                last = job.is_last(delivered)
            if last:
                del self._jobs[event.id]
                model.in_flight -= 1
                if event.id in self._cancelled:
                    self._cancelled.discard(event.id)
                    model.closing -= 1

    def _answer_call(self, call_id: int, result: bytes | APIError) -> None:
        future = self._calls.pop(call_id, None)
        if future is None or future.done():
            return
        if isinstance(result, APIError):
            future.set_exception(result)
        else:
            future.set_result(result)
