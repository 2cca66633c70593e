"""What the API process and the engine process say to each other, and how it is framed.

Every message is a msgspec ``Struct`` tagged with its class name and encoded as MessagePack:
no pickle, so a frame decodes only to one of the types below, each field type-checked on the
way in (a wrong field is a ``msgspec.ValidationError``, not a silent surprise later). A frame
is a 4-byte big-endian length, then the message.

API → engine: :class:`EngineConfig` (once, first), then :data:`ToEngine` messages.
Engine → API: :data:`FromEngine` messages. A job (one ``Submit``) ends with exactly one
terminal event: its last :class:`Token` (``finish_reason`` set), :class:`Failed`,
:class:`Dropped` (the answer to a ``Cancel``), or :class:`Scores` when it only scores its
prompt. Times are ``time.monotonic()``, one clock for every process on the machine.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
from typing import Any

import msgspec

from model.sampling import SamplingParams

HEADER = struct.Struct("!I")  # the payload's length in bytes


class EngineConfig(msgspec.Struct, tag=True):
    """What the engine process loads and how it decodes (from the server's settings)."""

    models: list[tuple[str, str]]  # (name, checkpoint folder), in loading order
    checkpoints: str  # the checkpoints folder (error messages are relative to it)
    device: str
    dtype: str
    threads: int
    max_batch_size: int
    max_context: int | None
    prefill_chunk: int
    stream_interval: float
    rope_variants: list[str]


class Submit(msgspec.Struct, tag=True, array_like=True):
    """Run one job: generate up to ``max_tokens`` (0: only score the prompt)."""

    id: int
    model: str
    prompt_ids: list[int]
    max_tokens: int
    stop: list[str]
    eos_id: int | None  # None: <|eos|> is an ordinary token
    params: SamplingParams
    logprobs: int | None  # top logprobs per token; None: none
    score_prompt: bool  # also send the prompt's logprobs (echo)
    submitted_at: float


class Cancel(msgspec.Struct, tag=True, array_like=True):
    id: int


class Trace(msgspec.Struct, tag=True, array_like=True):
    """Trace one prompt (``POST /v1/trace``); ``request`` is the validated TraceRequest's JSON."""

    id: int
    model: str
    prompt_ids: list[int]
    request: bytes


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Fail what is left (503) and exit."""


class ModelInfo(msgspec.Struct):
    """What the API process needs to know of a loaded model (it holds no weights)."""

    name: str
    base: str  # the checkpoint folder's model (``name`` unless a rope variant)
    scheme: str
    positional: dict[str, Any]
    context_length: int  # the length it was trained at
    max_positions: int | None  # the scheme's own cap (None: none)
    max_context: int
    parameters: int
    load_seconds: float


class ModelLoading(msgspec.Struct, tag=True, array_like=True):
    """The engine starts loading a checkpoint: if the process dies before the model is loaded
    or failed, that checkpoint killed it (and is not loaded again)."""

    name: str


class ModelLoaded(msgspec.Struct, tag=True, array_like=True):
    info: ModelInfo


class ModelFailed(msgspec.Struct, tag=True, array_like=True):
    name: str
    message: str  # paths relative to the checkpoints folder


class Token(msgspec.Struct, tag=True, array_like=True):
    """One generated token, the text it completes (maybe ""), and its logprobs if asked."""

    id: int
    token: int
    text: str
    finish_reason: str | None  # set on the job's last token: "stop" | "length"
    logprob: float | None = None
    top_ids: list[int] | None = None
    top_values: list[float] | None = None


class Scores(msgspec.Struct, tag=True, array_like=True):
    """Log-probabilities of the prompt's tokens after the first (a full forward pass)."""

    id: int
    logprobs: list[float]
    top_ids: list[list[int]]
    top_values: list[list[float]]


class Failed(msgspec.Struct, tag=True, array_like=True):
    """The job (or trace) ended with an error, answered to its client as this status."""

    id: int
    status: int
    message: str
    code: str | None = None


class Dropped(msgspec.Struct, tag=True, array_like=True):
    """A cancelled job has left the engine."""

    id: int


class Finish(msgspec.Struct, array_like=True):
    """A job that ended without failing: "stop" / "length" / "abort" (cancelled)."""

    reason: str
    e2e: float = 0.0  # seconds, arrival → last token (not observed for "abort")
    decode: float = 0.0  # first → last token
    generated: int = 0


class ModelStats(msgspec.Struct, array_like=True):
    """One model's metric changes since the previous frame (gauges: their value now)."""

    model: str
    running: int
    waiting: int
    prompt_tokens: list[int] = []  # per admitted request
    generation_tokens: int = 0
    queue_times: list[float] = []
    first_tokens: list[tuple[float, float]] = []  # (arrival → first token, row → first token)
    inter_token: list[float] = []  # one per decode step
    finished: list[Finish] = []
    failures: dict[str, int] = {}  # reason → requests


Event = Token | Scores | Failed | Dropped


class Outputs(msgspec.Struct, tag=True, array_like=True):
    """Events in the order they happened, and the stats of the models that changed."""

    events: list[Event]
    stats: list[ModelStats]


class TraceDone(msgspec.Struct, tag=True, array_like=True):
    id: int
    body: bytes  # the trace's JSON


ToEngine = Submit | Cancel | Trace | Shutdown
FromEngine = ModelLoading | ModelLoaded | ModelFailed | Outputs | TraceDone

_encoder = msgspec.msgpack.Encoder()


def frame(message: msgspec.Struct) -> bytes:
    """``message`` as one frame: length, then MessagePack."""
    payload = _encoder.encode(message)
    return HEADER.pack(len(payload)) + payload


class Channel:
    """The engine process's end of the socket: blocking sends (whole frames, from any thread),
    polled receives."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setblocking(True)
        self._buffer = bytearray()
        self._decoder = msgspec.msgpack.Decoder(ToEngine)
        self.closed = False  # the other end has gone
        self._sending = threading.Lock()

    def send(self, message: msgspec.Struct) -> None:
        data = frame(message)
        with self._sending:
            self.sock.sendall(data)

    def config(self) -> EngineConfig:
        """The first message: what to load."""
        while True:
            payload = self._next_payload()
            if payload is not None:
                return msgspec.msgpack.decode(payload, type=EngineConfig)
            if not self._read(None):
                raise ConnectionError("the API process closed the socket before configuring")

    def receive(self, timeout: float | None) -> list[ToEngine]:
        """Every message that has arrived, waiting up to ``timeout`` s (None: until one does)."""
        messages: list[ToEngine] = []
        while True:
            while (payload := self._next_payload()) is not None:
                messages.append(self._decoder.decode(payload))
            if messages or self.closed or not self._read(timeout):
                return messages
            timeout = 0.0  # something arrived; take the rest without waiting

    def _read(self, timeout: float | None) -> bool:
        """Read what is there (after waiting up to ``timeout``); False if nothing came."""
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return False
        try:
            data = self.sock.recv(1 << 16)
        except OSError:  # reset: the same as closed
            data = b""
        if not data:
            self.closed = True
            return False
        self._buffer += data
        return True

    def _next_payload(self) -> bytes | None:
        if len(self._buffer) < HEADER.size:
            return None
        (length,) = HEADER.unpack_from(self._buffer)
        end = HEADER.size + length
        if len(self._buffer) < end:
            return None
        payload = bytes(self._buffer[HEADER.size : end])
        del self._buffer[:end]
        return payload
