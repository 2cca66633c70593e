"""The tests' reach into the engine process: a thread there that installs gates and faults.

``running_server`` starts every test server's engine with :func:`run_controlled` and keeps the
other end of a pipe: :class:`Control`. Each command runs in the engine process, on the objects
the engine decodes with, so the tests hold, break or poison the real engine across the process
boundary:

- a **gate** makes each forward pass of a model wait for one permit (``Gate``);
- **poison** turns one seeded request's logits NaN once it has generated some tokens;
- a **failing sampler** makes one seeded request's generator raise on a later draw;
- **break** makes a model's forward raise (a failed step);
- **count threads** records the decode kernel's thread count in each forward;
- **mask budget** sets the CPU time a grammar's mask may take in the engine alone.
- **hold a model** keeps one checkpoint from loading until released (the others load);
- **a fake cgroup** points the memory checks (``model.memory``) at a hierarchy of files.
"""

from __future__ import annotations

import math
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

import server.engine.core
import server.engine.engine
import server.engine.loader
from model import grammar as grammar_module
from model import memory
from model.kernels import decode_step
from model.sampling import RowSampler
from server.engine.core import EngineCore, run_engine_process

# A model's passes a fault or gate wraps: its forward, and the decode kernel's pass that carries
# prompts beside the decoding rows.
PASSES = ("forward", "decode_entries")

Command = tuple[Any, ...]


def run_controlled(
    sock: Any, control: Connection, hold_loading: bool = False, crash_loading: str | None = None
) -> None:
    """The engine process's entry point in the tests (see ``server.api.client.Launcher``).

    ``hold_loading``: no model loads until the ``release_loading`` command. ``crash_loading``:
    the process is SIGKILLed (as by the kernel's OOM killer) when it starts loading the
    checkpoint folder of that name, after appending a line to the file ``attempts`` beside it.
    """
    if crash_loading is not None:
        crash_while_loading(crash_loading)

    def setup(core: EngineCore) -> None:
        controller = Controller(core, control)
        if hold_loading:
            controller.hold_loading()
        controller.start()

    run_engine_process(sock, setup=setup)


def crash_while_loading(name: str) -> None:
    load_checkpoint = server.engine.loader.load_checkpoint

    def crashing(folder: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(folder).name == name:
            with open(Path(folder).parent / "attempts", "a") as attempts:
                attempts.write(f"{os.getpid()}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return load_checkpoint(folder, *args, **kwargs)

    server.engine.loader.load_checkpoint = crashing  # type: ignore[assignment]


class Controller(threading.Thread):
    """Runs the test process's commands in the engine process, one reply per command."""

    def __init__(self, core: EngineCore, control: Connection) -> None:
        super().__init__(name="engine-control", daemon=True)
        self.core = core
        self.control = control
        self.gates: dict[str, threading.Semaphore] = {}
        self.passed: dict[str, int] = {}
        # each gated model's passes as they were (None: the class's)
        self.ungated: dict[str, dict[str, Callable[..., Any] | None]] = {}
        self.loading = threading.Event()
        self.held_model = threading.Event()
        self.threads_seen_by: dict[str, list[int]] = {}

    def hold_loading(self) -> None:
        load_all = server.engine.core.load_all

        def held(config: Any, *args: Any, **kwargs: Any) -> Any:
            self.loading.wait(60)
            return load_all(config, *args, **kwargs)

        server.engine.core.load_all = held  # type: ignore[assignment]

    def release_loading(self) -> None:
        self.loading.set()

    def hold_model(self, name: str) -> None:
        """The checkpoint folder ``name`` loads only once ``release_model`` is called (before
        ``release_loading``: the loader reads this when it reaches it)."""
        held = self.held_model = threading.Event()
        load_checkpoint = server.engine.loader.load_checkpoint

        def holding(folder: Any, *args: Any, **kwargs: Any) -> Any:
            if Path(folder).name == name:
                held.wait(60)
            return load_checkpoint(folder, *args, **kwargs)

        server.engine.loader.load_checkpoint = holding  # type: ignore[assignment]

    def release_model(self) -> None:
        self.held_model.set()

    def fake_cgroup(self, root: str, own_groups: str) -> None:
        """Memory checks read the cgroup hierarchy at ``root``, this process's groups from the
        file ``own_groups`` (as ``/proc/self/cgroup``)."""
        memory.CGROUP_ROOT = Path(root)
        memory.PROC_CGROUP = Path(own_groups)

    def run(self) -> None:
        while True:
            try:
                command, *args = self.control.recv()
            except (EOFError, OSError):
                return
            try:
                reply: Any = getattr(self, command)(*args)
            except Exception as error:  # the test process sees what went wrong
                reply = error
            self.control.send(reply)

    def _model(self, name: str) -> torch.nn.Module:
        return self.core.engines[name].batch.model

    def _wrap(self, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Every pass of the model goes through ``wrapper``: its forward, and the decode kernel's
        pass with prompts (``decode_entries``)."""
        model = self._model(name)
        for attribute in PASSES:
            setattr(model, attribute, wrapper(getattr(model, attribute)))

    def pid(self) -> int:
        return os.getpid()

    def gate(self, name: str) -> None:
        permits = self.gates[name] = threading.Semaphore(0)
        self.passed[name] = 0
        model = self._model(name)
        self.ungated[name] = {attribute: model.__dict__.get(attribute) for attribute in PASSES}

        def wrapper(forward: Callable[..., Any]) -> Callable[..., Any]:
            def gated(*args: Any, **kwargs: Any) -> Any:
                permits.acquire()
                self.passed[name] += 1
                return forward(*args, **kwargs)

            return gated

        self._wrap(name, wrapper)

    def allow(self, name: str, steps: int) -> None:
        self.gates[name].release(steps)

    def passes(self, name: str) -> int:
        return self.passed[name]

    def ungate(self, name: str) -> None:
        """Remove the gate (and let through any forward it holds); faults under it stay."""
        self.gates.pop(name).release(10_000)
        model = self._model(name)
        for attribute, kept in self.ungated.pop(name).items():
            if kept is None:
                model.__dict__.pop(attribute, None)
            else:
                setattr(model, attribute, kept)

    def poison(self, name: str, seed: int, after: int) -> None:
        """Decode steps give NaN logits to the row seeded ``seed`` once it has ``after`` tokens
        (the decoding rows come first in a decode pass, with prompts after them or without)."""
        batch = self.core.engines[name].batch

        def wrapper(forward: Callable[..., Any]) -> Callable[..., Any]:
            def poisoned(tokens: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                logits = forward(tokens, *args, **kwargs)
                plan = args[1] if len(args) > 1 else None  # decode_entries(tokens, cache, plan, …)
                with_prompts = getattr(plan, "slot_rows", None) is not None
                step = with_prompts or kwargs.get("rows") == slice(0, batch.decoding)
                if tokens.shape[1] == 1 and step:
                    for position, row in enumerate(batch.members[: batch.decoding]):
                        bad = row.sampler.params.seed == seed
                        if bad and len(row.tokens.generated_ids) >= after:
                            logits[position] = math.nan
                return logits

            return poisoned

        self._wrap(name, wrapper)

    def failing_sampler(self, seed: int, after: int) -> None:
        """The request seeded ``seed`` gets a generator that raises after ``after`` draws."""

        class Failing(RowSampler):
            draws = 0

            def next_uniform(self) -> float:
                self.draws += 1
                if self.params.seed == seed and self.draws > after:
                    raise RuntimeError("this row's generator broke")
                return super().next_uniform()

        server.engine.engine.RowSampler = Failing  # type: ignore[misc]

    def break_model(self, name: str) -> None:
        def wrapper(forward: Callable[..., Any]) -> Callable[..., Any]:
            def broken(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("a device error")

            return broken

        self._wrap(name, wrapper)

    def count_threads(self, name: str) -> None:
        """Each pass of the model records how many threads the decode-step kernel's loops
        use in the thread running it (``threads_seen``)."""
        seen = self.threads_seen_by[name] = []

        def wrapper(forward: Callable[..., Any]) -> Callable[..., Any]:
            def counted(*args: Any, **kwargs: Any) -> Any:
                seen.append(decode_step.parallel_threads())
                return forward(*args, **kwargs)

            return counted

        self._wrap(name, wrapper)

    def threads_seen(self, name: str) -> list[int]:
        return self.threads_seen_by[name]

    def share_attention(self, on: bool, order: str) -> None:
        """Large steps share their attention with the kernel's helper thread, the two threads
        meeting in ``order`` (``decode_step.share_large_steps``)."""
        decode_step.share_large_steps(on, order)

    def shared_rows(self) -> tuple[int, int]:
        return decode_step.shared_rows()

    def shares_large_steps(self) -> bool:
        return decode_step.shares_large_steps()

    def mask_budget(self, seconds: float) -> float:
        """A grammar's masks may take ``seconds`` of CPU in the engine (the API process checks
        a grammar with its own ``model.grammar.MASK_BUDGET``); returns the budget it replaces."""
        replaced, grammar_module.MASK_BUDGET = grammar_module.MASK_BUDGET, seconds
        return replaced

    def idle_shrink(self, seconds: float) -> None:
        """Models' caches shrink after ``seconds`` idle (``server.engine.engine.IDLE_SHRINK``)."""
        server.engine.engine.IDLE_SHRINK = seconds

    def allocated(self, name: str) -> tuple[int, int]:
        """(rows, positions) the model's KV cache holds allocated now."""
        return self.core.engines[name].batch.cache.allocated

    def reset(self, name: str | None = None) -> None:
        """Undo every gate and fault (of ``name``, or of every model), opening gates first."""
        names = list(self.core.engines) if name is None else [name]
        for model in names:
            if model in self.gates:
                self.gates.pop(model).release(10_000)
            self.ungated.pop(model, None)
            for attribute in PASSES:  # the class's passes again
                self._model(model).__dict__.pop(attribute, None)
        if name is None:
            server.engine.engine.RowSampler = RowSampler  # type: ignore[misc]


class Control:
    """The test process's end: ``call("gate", "rope")`` runs ``Controller.gate("rope")``."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._lock = threading.Lock()

    def call(self, command: str, *args: Any) -> Any:
        with self._lock:
            self.connection.send((command, *args))
            reply = self.connection.recv()
        if isinstance(reply, Exception):
            raise reply
        return reply


class Gate:
    """Holds a model's forward passes in the engine process until released.

    While installed, each forward pass of the model waits for one permit.
    """

    def __init__(self, control: Control, model: str) -> None:
        self.control = control
        self.model = model
        self.given = 0  # permits released so far
        self.opened = False
        control.call("gate", model)

    @property
    def passed(self) -> int:
        """Forwards that went through."""
        return self.control.call("passes", self.model)

    def allow(self, steps: int = 1) -> None:
        self.given += steps
        self.control.call("allow", self.model, steps)

    @property
    def settled(self) -> bool:
        """Every permit given has been used: the model is held before its next forward."""
        return self.passed == self.given

    def open(self) -> None:
        """Let every forward through from now on, and remove the gate."""
        if not self.opened:
            self.opened = True
            self.control.call("ungate", self.model)
