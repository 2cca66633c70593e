"""The engine process: every served model, loaded once, decoded by one loop beside the API.

The API process (``server.api.client``) starts this process and talks to it over one socket
(``server.messages``). The loop, in the process's main thread:

1. takes the models a loader thread has finished loading (each announced as it is ready): the
   configured ones at start, then any the API process finds later (a ``Load`` message). A
   model loaded again replaces the one of its name, and one unloaded (``Unload``) goes: the
   engine it had finishes the jobs it holds (new ones go to its successor), then is dropped;
2. reads every message that has arrived — blocking only while there is nothing to decode (and
   at most ``COMPILE_POLL`` while a grammar compiles);
3. queues the jobs whose grammar has compiled, and runs one step of every model that has work
   (``server.engine.engine.ModelEngine``);
4. sends the step's events and metric changes in one frame. With ``stream_interval`` > 0 a
   frame of ordinary tokens may wait up to that long to travel with later ones; a job's first
   and last tokens, failures and answers to cancellations never wait (they leave in a frame of
   their job's events alone).

Calls (``server.engine.calls``: ``POST /v1/trace``) run here too, so the weights exist once:
queued as they arrive, they run one a turn of the loop, after the steps. A trace is one forward
of at most ``MAX_TRACE_TOKENS`` (256, the default prefill chunk) with its attention recorded, so
the streams decoding meanwhile wait about one prefill chunk between two tokens, however many
calls are queued (the API process bounds that per model: ``max_traces``, then 429). The process
ignores SIGINT (the API process decides when to stop: a ``Shutdown`` message) and exits when its
socket closes, so it never outlives the API process.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec
import torch

from model.grammar import GrammarError
from model.kernels import decode_step
from server.engine.calls import run_call
from server.engine.engine import ModelEngine, Outbox, speculation_of
from server.engine.loader import LoadedModel, load_all
from server.messages import (
    Call,
    Cancel,
    Channel,
    EngineConfig,
    Failed,
    Load,
    ModelFailed,
    ModelLoaded,
    ModelLoading,
    Returned,
    Shutdown,
    Submit,
    ToEngine,
    Unload,
)

logger = logging.getLogger("ordinal.engine")

LOAD_POLL = 0.05  # seconds between looks at the loader while nothing decodes
# Seconds between looks at a compiling grammar while nothing decodes: a few percent of a
# compile (the shortest take ~1 ms), and a wait the loop spends asleep.
COMPILE_POLL = 0.002


class EngineCore:
    """Every loaded model's engine, fed by ``channel``."""

    def __init__(self, config: EngineConfig, channel: Channel) -> None:
        self.config = config
        self.channel = channel
        self.outbox = Outbox(send=self._send)
        self.engines: dict[str, ModelEngine] = {}
        self._retiring: list[ModelEngine] = []  # replaced or unloaded: finishing their jobs
        # The loader thread's results; None ends one batch of models (the configured ones, or
        # one Load's). ``_loads`` batches are still to end, ``_requests`` holds those not begun.
        self._loaded: queue.SimpleQueue[LoadedModel | ModelFailed | None] = queue.SimpleQueue()
        self._requests: queue.SimpleQueue[list[tuple[str, str]]] = queue.SimpleQueue()
        self._requests.put(config.models)
        self._loads = 1
        self._last_send = 0.0
        self._calls: deque[Call] = deque()  # waiting to run, in arrival order

    @property
    def every_engine(self) -> list[ModelEngine]:
        """The engines that take jobs, then those finishing theirs before they go."""
        return [*self.engines.values(), *self._retiring]

    @property
    def busy(self) -> bool:
        return bool(self._calls) or any(not engine.idle for engine in self.every_engine)

    def run(self) -> None:
        """Serve until a ``Shutdown`` arrives or the API process goes away."""
        loader = threading.Thread(target=self._load, name="engine-loader", daemon=True)
        loader.start()
        with torch.inference_mode():
            while True:
                self._take_loaded()
                for message in self.channel.receive(self._wait()):
                    if isinstance(message, Shutdown):
                        self.shutdown()
                        return
                    self.handle(message)
                if self.channel.closed:
                    return
                self._send()  # answers to cancellations must not wait for a step
                for engine in self.every_engine:
                    if engine.compiling:
                        engine.take_compiled()
                    if not engine.idle:
                        engine.step()
                self._run_calls()
                self._send()
                self._drop_retired()
                now = time.monotonic()
                for engine in self.engines.values():
                    engine.shrink_if_due(now)

    def _wait(self) -> float | None:
        """How long the loop may wait for a message: not at all while there is work; else
        until the loader may have news, a grammar may have compiled, or a model's cache is due
        to shrink, or for ever."""
        if self.busy:
            return 0.0
        waits = [LOAD_POLL] if self._loads else []
        if any(engine.compiling for engine in self.every_engine):
            waits.append(COMPILE_POLL)
        dues = [due for engine in self.engines.values() if (due := engine.shrink_due) is not None]
        if dues:
            waits.append(max(0.0, min(dues) - time.monotonic()))
        return min(waits, default=None)

    def _load(self) -> None:
        pin_threads(1)  # the decode loop's thread count is its own
        # A helper thread needs a core of its own: on one, it would take the decode loop's.
        decode_step.share_large_steps(
            self.config.attention_helper and len(os.sched_getaffinity(0)) > 1
        )
        while True:  # the configured models, then each Load's, one batch after another
            models = self._requests.get()
            batch = msgspec.structs.replace(self.config, models=models)
            for result in load_all(
                batch, announce=lambda name: self.channel.send(ModelLoading(name))
            ):
                self._loaded.put(result)
            self._loaded.put(None)

    def _take_loaded(self) -> None:
        while self._loads and not self._loaded.empty():
            result = self._loaded.get()
            if result is None:
                self._loads -= 1
            elif isinstance(result, ModelFailed):
                logger.error("model '%s' failed to load: %s", result.name, result.message)
                self.channel.send(result)
            else:
                pin_threads(self.config.threads)  # what the loader's count of 1 changed
                if (replaced := self.engines.get(result.name)) is not None:
                    self._retiring.append(replaced)
                self.engines[result.name] = ModelEngine(
                    result,
                    self.config.max_batch_size,
                    self.config.prefill_chunk,
                    self.outbox,
                    self.config.prefix_cache_tokens,
                    self.config.cuda_graphs,
                    self.config.priority_aging,
                    speculation_of(self.config),
                )
                info = result.info()
                info.speculative = self.engines[result.name].speculative
                self.channel.send(ModelLoaded(info))
                # A full collection walks every tracked object: with fifteen models loaded, 300k of
                # them, 138 ms during which no stream gets a token. What exists once a model is
                # loaded lives as long as the process, so it is frozen out of the collector's
                # way (as vLLM's engine does); the collections go on for what comes later.
                gc.freeze()

    def handle(self, message: ToEngine) -> None:
        if isinstance(message, Submit):
            if (engine := self._engine_for(message)) is not None:
                engine.submit(message)
        elif isinstance(message, Cancel):
            for engine in self.every_engine:
                engine.cancel(message.id)
        elif isinstance(message, Call):
            self._calls.append(message)
        elif isinstance(message, Load):
            self._loads += 1
            self._requests.put([(message.name, message.folder)])
        elif isinstance(message, Unload):  # the checkpoint and its rope variants
            for name, engine in list(self.engines.items()):
                if engine.loaded.base == message.name:
                    self._retiring.append(self.engines.pop(name))

    def _drop_retired(self) -> None:
        """Drop the retiring engines that have finished their jobs. Their objects were frozen
        out of the collector's way when they loaded (_take_loaded): unfrozen for one
        collection, so that a model replaced again and again does not pile up."""
        still = [engine for engine in self._retiring if not engine.idle or engine.compiling]
        if len(still) == len(self._retiring):
            return
        dropped = [engine.name for engine in self._retiring if engine not in still]
        self._retiring = still
        logger.info("dropped the engines of %s, replaced or unloaded", ", ".join(dropped))
        gc.unfreeze()
        gc.collect()
        gc.freeze()

    def _engine_for(self, message: Submit | Call) -> ModelEngine | None:
        """The engine of the message's model, or None after answering 503 for it."""
        engine = self.engines.get(message.model)
        if engine is None:
            failed = Failed(message.id, 503, f"model '{message.model}' is not loaded")
            self.outbox.add(failed, urgent=True)
        return engine

    def _run_calls(self) -> None:
        """The call waiting first, if any: one a turn of the loop, between the steps."""
        if self._calls:
            self._call(self._calls.popleft())

    def _call(self, message: Call) -> None:
        if (engine := self._engine_for(message)) is None:
            return
        try:
            body = run_call(engine.loaded, message.method, message.args)
        except GrammarError as error:  # the request's grammar, checked by the API, failed here
            self.outbox.add(Failed(message.id, 400, f"structured output: {error}"), urgent=True)
            return
        except Exception:
            logger.exception("model '%s': %s failed", message.model, message.method)
            self.outbox.add(Failed(message.id, 500, f"the {message.method} failed"), urgent=True)
            return
        self.channel.send(Returned(message.id, body))

    def _send(self) -> None:
        """Send the whole outbox once ``stream_interval`` has passed since it was last sent
        whole (or nothing decodes); before that, only the jobs that have an event that must not
        wait (``Outbox.take``)."""
        if not self.outbox.events and not self.outbox.stats:
            return
        now = time.monotonic()
        due = now - self._last_send >= self.config.stream_interval or not self.busy
        if not (due or self.outbox.urgent):
            return
        outputs = self.outbox.take(everything=due)
        if outputs is not None:
            self.channel.send(outputs)
        if due:
            self._last_send = now

    def shutdown(self) -> None:
        for engine in self.every_engine:
            engine.shutdown()
        outputs = self.outbox.take()
        if outputs is not None:
            self.channel.send(outputs)


def run_engine_process(
    sock: socket.socket, setup: Callable[[EngineCore], None] | None = None
) -> None:
    """The engine process's entry point (``multiprocessing`` target): configure, then serve.

    ``setup`` runs with the core before it serves (the tests use it to reach into the process).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the API process, which stops us
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    status = 0
    try:
        serve_engine(sock, setup)
    except BaseException:
        logger.exception("the engine process failed")
        status = 1
    # Skip the interpreter's teardown: after torch has run in the loader thread it hung in
    # native code (no Python frame) for as long as we waited; nothing is left to clean up.
    logging.shutdown()
    os._exit(status)


def pin_threads(count: int) -> None:
    """Give the calling thread ``count`` torch threads.

    ``torch.set_num_threads`` sets the caller's count and a process-wide one, and every library
    built on ATen (torch, and each of ``model.kernels``) copies the process-wide count into a
    thread on that library's first parallel loop there. The loader thread sets 1 for itself, so
    the decode loop sets its own count back before each model it takes (before any step): when
    it did so only at start, its kernels' first loops copied the loader's 1 and ``--threads 2``
    decoded on one thread. Reading the count at once makes torch's own copy now.
    """
    torch.set_num_threads(count)
    torch.get_num_threads()


def serve_engine(sock: socket.socket, setup: Callable[[EngineCore], None] | None = None) -> None:
    """Read the configuration from ``sock``, load, and serve until told to stop."""
    channel = Channel(sock)
    try:
        config = channel.config()
    except (ConnectionError, msgspec.DecodeError):
        return
    core = EngineCore(config, channel)
    if setup is not None:
        setup(core)
    try:
        core.run()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the API process has gone: nobody is left to answer
    finally:
        sock.close()
