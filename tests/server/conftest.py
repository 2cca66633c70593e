"""A real server for the service tests: tiny random checkpoints of every scheme in a tmp folder,
served by uvicorn on a free loopback port from a background thread (session-scoped: it starts
once). ``running_server`` starts extra servers with other settings (API key, tiny queue, ...)."""

from __future__ import annotations

import multiprocessing
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import torch
import uvicorn
from tokenizers import Tokenizer

from model.checkpoint import save_checkpoint
from model.config import ModelConfig
from model.positional import SCHEMES
from model.tokenizer import train_tokenizer
from model.transformer import Transformer
from server.api.app import create_app, serving
from server.api.client import Launcher, ModelClient
from server.api.service import Service
from server.api.settings import Settings
from server.messages import EngineConfig
from tests.model.conftest import SCHEME_SETTINGS
from tests.server.engine_control import Control, Gate

assert set(SCHEME_SETTINGS) == set(SCHEMES)

TEXT = [
    "Now is the winter of our discontent made glorious summer by this sun of York.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.",
    "All the world's a stage, and all the men and women merely players.",
    "If music be the food of love, play on; give me excess of it. Ça va, naïve café — ¿sí?",
]
CONTEXT_LENGTH, MAX_POSITIONS = 32, 64

# Tiny models: a second torch thread only adds synchronisation on a shared, busy machine.
torch.set_num_threads(1)


def tiny_tokenizer() -> Tokenizer:
    return train_tokenizer(TEXT, vocab_size=300)


def tiny_model(scheme: str, vocab_size: int, seed: int) -> Transformer:
    """A random 2-layer, 32-dim model. Weights are redrawn with a large spread so that logits
    (and so logprobs) depend visibly on content and position."""
    config = ModelConfig(
        vocab_size=vocab_size,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        context_length=CONTEXT_LENGTH,
        max_positions=MAX_POSITIONS,
        # LayerNorm would remove integer's position (it adds the same to every dimension).
        norm="rmsnorm" if scheme == "integer" else "layernorm",
        positional={"scheme": scheme, **SCHEME_SETTINGS[scheme]},
    )
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and "norm" not in name:
                tensor.normal_(0, 0.3 if name.startswith("positional.") else 0.15)
    return model.eval()


def build_checkpoints(folder: Path) -> None:
    """One tiny checkpoint per scheme in ``folder``, all sharing one tokenizer."""
    tokenizer = tiny_tokenizer()
    for seed, scheme in enumerate(SCHEME_SETTINGS):
        model = tiny_model(scheme, tokenizer.get_vocab_size(), seed)
        save_checkpoint(folder / scheme, model, tokenizer)


@dataclass
class Running:
    url: str
    service: Service
    control: Control  # reaches into the engine process

    def engine(self, model: str) -> ModelClient:
        return self.service.models[model].engine

    def gate(self, model: str) -> Gate:
        return Gate(self.control, model)


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def running_server(
    settings: Settings,
    wait_ready: bool = True,
    hold_loading: bool = False,
    crash_loading: str | None = None,
) -> Iterator[Running]:
    """Serve ``settings`` with uvicorn in a background thread until the block ends; the
    engine process runs under ``tests.server.engine_control`` (``running.control``), forked
    from a server process that imported torch once for the whole session. ``hold_loading``:
    its models load only once ``running.control.call("release_loading")``; ``crash_loading``:
    every engine is killed when it starts loading that model (``engine_control``)."""
    ours, theirs = multiprocessing.get_context("forkserver").Pipe()
    launcher = Launcher(
        "tests.server.engine_control:run_controlled",
        (theirs, hold_loading, crash_loading),
        method="forkserver",
        preload=("server.api.client", "tests.server.engine_control"),
    )
    app = create_app(settings, launcher)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **serving(settings)))
    sock = free_socket()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    running = Running(url, app.state.service, Control(ours))
    try:
        wait_for(lambda: server.started, "uvicorn to start")
        if wait_ready:
            # The first engine of a session waits for the fork server to import torch.
            wait_for(lambda: running.service.settled, "the models to load", timeout=300)
        yield running
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        ours.close()
        theirs.close()


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.005)


def engine_config(
    folders: dict[str, Path], root: Path, rope_variants: list[str] | None = None
) -> EngineConfig:
    """What an engine process is sent to load ``folders`` (on the CPU, a batch of 4, chunks of
    16 prompt tokens), for the tests that load models without a process."""
    return EngineConfig(
        models=[(name, str(folder)) for name, folder in folders.items()],
        checkpoints=str(root),
        device="cpu",
        dtype="float32",
        threads=1,
        max_batch_size=4,
        max_context=None,
        prefill_chunk=16,
        stream_interval=0.0,
        rope_variants=rope_variants or [],
    )


def test_settings(folder: Path, **changes: Any) -> Settings:
    fields: dict[str, Any] = {"checkpoints": folder, "device": "cpu", "threads": 1}
    return Settings(**{**fields, **changes})


test_settings.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test


@pytest.fixture(scope="session")
def server(checkpoints: Path) -> Iterator[Running]:
    # stream_interval 0: every step's events leave at once, which the gate tests rely on.
    settings = test_settings(checkpoints, max_batch_size=8, max_queue=32, stream_interval=0)
    with running_server(settings) as running:
        yield running


@pytest.fixture
def client(server: Running) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any] | str]:
    """Parsed ``data:`` payloads of an SSE stream: dicts, then the final "[DONE]"."""
    for line in lines:
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            yield payload if payload == "[DONE]" else orjson.loads(payload)


@pytest.fixture
def gate(server: Running) -> Iterator[Callable[[str], Gate]]:
    """``gate(model_name)`` installs a Gate on that model; it is opened after the test."""
    gates: list[Gate] = []

    def install(model: str) -> Gate:
        gates.append(server.gate(model))
        return gates[-1]

    yield install
    for installed in gates:
        installed.open()


def openai_client(running: Running) -> Any:
    """OpenAI's own Python client, pointed at ``running`` (no retries: a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
