"""What the API process and the engine process say to each other, and how it is framed.

Every message is a msgspec ``Struct`` tagged with its class name and encoded as MessagePack:
no pickle, so a frame decodes only to one of the types below, each field type-checked on the
way in (a wrong field is a ``msgspec.ValidationError``, not a silent surprise later). A frame
is a 4-byte big-endian length, then the message.

API → engine: :class:`EngineConfig` (once, first), then :data:`ToEngine` messages.
Engine → API: :data:`FromEngine` messages. A job (one ``Submit``) ends with exactly one
terminal event: its last :class:`Token` (``finish_reason`` set), :class:`Failed`,
:class:`Dropped` (the answer to a ``Cancel``), or :class:`Scores` when it only scores its
prompt. A :class:`Call` (work that generates nothing, such as a trace) ends with its
:class:`Returned` or a :class:`Failed`. Times are ``time.monotonic()``, one clock for every
process on the machine.

Both processes import this module, and it imports nothing of either: only msgspec and the
torch-free ``model.sampling_params``.
"""

from __future__ import annotations

import re
import select
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import msgspec

from model.sampling_params import SamplingParams

# The metrics' failure reasons the engine reports itself (beside model.sampling_params'
# FailureReason, a row's own failure); the API process adds its own (server.api.metrics).
MODEL_ERROR = "model_error"  # the batch's forward pass raised: every row in it failed
SHUTDOWN = "shutdown"  # the server stopped while the request was running or queued

HEADER = struct.Struct("!I")  # the payload's length in bytes

# A rope model's context-extension variant, as EngineConfig.rope_variants names it.
ROPE_VARIANT = re.compile(r"^(linear|ntk|dynamic|yarn)([0-9]+(?:\.[0-9]+)?)$")


def parse_rope_variant(variant: str) -> tuple[str, float]:
    """ "yarn4" → ("yarn", 4.0): a rope scaling of model.positional.rope and its factor ≥ 1."""
    match = ROPE_VARIANT.match(variant)
    if match is None or float(match[2]) < 1:
        raise ValueError(
            f"rope variant {variant!r} is not SCALING+FACTOR with SCALING one of linear, ntk, "
            "dynamic, yarn and FACTOR ≥ 1 (e.g. yarn4)"
        )
    return match[1], float(match[2])


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
    rope_variants: list[str]  # "yarn4": parse_rope_variant
    prefix_cache_tokens: int = 0  # per model; 0: no prefix cache
    cuda_graphs: bool = True  # on a GPU, decode steps replayed from CUDA graphs
    attention_helper: bool = False  # on a CPU, large steps share their attention with a thread
    priority_aging: float = 0.0  # seconds of waiting worth one level of priority; 0: none
    speculative: str | None = None  # "ngram": rows decode by exact speculation
    num_speculative_tokens: int = 3  # the most draft tokens a row verifies per step
    prompt_lookup_max: int = 4  # the longest and shortest n-gram a draft is looked up by
    prompt_lookup_min: int = 2


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
    priority: int = 0  # vLLM's: a lower one is admitted sooner


class Cancel(msgspec.Struct, tag=True, array_like=True):
    id: int


class Call(msgspec.Struct, tag=True, array_like=True):
    """Run the engine function ``method`` (``server.engine.calls.CALLS``) on one model, with
    ``args`` as its keyword arguments (already checked by the API process): one message for
    every endpoint that computes with the weights but generates nothing (``POST /v1/trace``)."""

    id: int
    model: str
    method: str
    args: dict[str, Any]


class Load(msgspec.Struct, tag=True, array_like=True):
    """Load one more checkpoint (a folder that appeared in the served folder while serving):
    announced, then loaded or failed, as a configured model is."""

    name: str
    folder: str


class Unload(msgspec.Struct, tag=True, array_like=True):
    """Stop serving checkpoint ``name`` (and its rope variants): new jobs are refused, those it
    holds finish first (its folder was removed)."""

    name: str


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Fail what is left (503) and exit."""


class ModelInfo(msgspec.Struct):
    """What the API process needs to know of a loaded model (it holds no weights)."""

    name: str
    base: str  # the checkpoint folder's model (``name`` unless a rope variant)
    scheme: str
    kind: str  # the scheme's model.positional.base.SchemeKind ("added", "rotation", ...)
    claim: str  # what the scheme predicts one should see, in one line (PositionalScheme.claim)
    positional: dict[str, Any]
    context_length: int  # the length it was trained at
    max_positions: int | None  # the scheme's own cap (None: none)
    max_context: int
    n_layers: int
    n_heads: int
    parameters: int
    load_seconds: float
    decode_backend: str  # model.backend's: "cpu-kernel", "cuda-graphs" or "torch"
    cpu_isa: str | None  # the kernel variant decoding it ("avx2", ...), or None
    # "ngram, up to K tokens", or "off: why" where the server asked and the model cannot verify
    # exactly (model.speculative.refusal); None: not asked for
    speculative: str | None = None


class ModelLoading(msgspec.Struct, tag=True, array_like=True):
    """The engine starts loading a checkpoint: if the process dies before the model is loaded
    or failed, that checkpoint killed it (and is not loaded again)."""

    name: str


class ModelLoaded(msgspec.Struct, tag=True, array_like=True):
    info: ModelInfo


class ModelFailed(msgspec.Struct, tag=True, array_like=True):
    name: str
    message: str  # paths relative to the checkpoints folder (failure_message)


def failure_message(error: Exception, root: Path) -> str:
    """What went wrong loading a model, with paths relative to the checkpoints folder (a
    client has no business knowing where the server keeps its files)."""
    message = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
    for prefix in {str(root.resolve()), str(root)}:
        message = message.replace(prefix.rstrip("/") + "/", "")
    return message


class Token(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """One generated token, the text it completes (maybe ""), and its logprobs if asked.
    Trailing fields left at their defaults are not sent (most tokens carry none of them)."""

    id: int
    token: int
    text: str
    finish_reason: str | None  # set on the job's last token: "stop" | "length"
    logprob: float | None = None
    top_ids: list[int] | None = None
    top_values: list[float] | None = None
    cached_tokens: int = 0  # on a job's first token: prompt tokens reused from the prefix cache
    queue_time: float = 0.0  # on a job's first token: seconds from submitted to admitted
    stop: str | None = None  # on a job's last token: the stop string that ended it, if one did


class Scores(msgspec.Struct, tag=True, array_like=True):
    """Log-probabilities of the prompt's tokens after the first (a full forward pass)."""

    id: int
    logprobs: list[float]
    top_ids: list[list[int]]
    top_values: list[list[float]]


class Failed(msgspec.Struct, tag=True, array_like=True):
    """The job (or call) ended with an error, answered to its client as this status."""

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
    kv_cache_usage: float = 0.0  # gauge: the fraction of the KV cache's most in use
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache (vLLM's counters)
    prefix_hits: int = 0  # of those, the tokens it held
    spec_drafts: int = 0  # speculative proposals verified (vLLM's spec_decode counters)
    spec_draft_tokens: int = 0  # the tokens they proposed
    spec_accepted_tokens: int = 0  # of those, the tokens kept


Event = Token | Scores | Failed | Dropped


class Outputs(msgspec.Struct, tag=True, array_like=True):
    """Events in the order they happened, and the stats of the models that changed."""

    events: list[Event]
    stats: list[ModelStats]


class Returned(msgspec.Struct, tag=True, array_like=True):
    """What a :class:`Call` returned, as the JSON its endpoint answers."""

    id: int
    body: bytes


ToEngine = Submit | Cancel | Call | Load | Unload | Shutdown
FromEngine = ModelLoading | ModelLoaded | ModelFailed | Outputs | Returned

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
