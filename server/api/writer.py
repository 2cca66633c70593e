"""Turning a job's events into OpenAI's completion JSON.

The response is a sequence of *pieces* (text, logprobs, finish_reason): the echoed prompt
first if asked for, then one piece per generated token. A stream sends each piece as one
``data: {chunk}`` SSE event; the non-stream answer joins them.
"""

from __future__ import annotations

import codecs
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from server.api.errors import APIError, error_event
from server.api.job import Failure, Job
from server.api.schemas import CompletionRequest
from server.api.service import ServedModel
from server.api.sse import DONE, sse_event
from server.messages import Scores, Token

Logprobs = dict[str, list[Any]]
Piece = tuple[str, Logprobs | None, str | None]  # text, logprobs, finish_reason


def joined(pieces: list[Piece]) -> list[Piece]:
    """``pieces`` that arrived together, each run without logprobs as one piece (texts joined,
    the last one's finish_reason). A stream's tokens that waited for one frame
    (``--stream-interval``) then leave as one event, as vLLM's output collector joins what its
    reader has not yet taken: at 32 streams the benchmark's client spent 0.10 core against 0.21
    for the same tokens (docs/performance-log.md, fourteenth round). A piece with logprobs stays an
    event of its own: clients read one token's logprobs per chunk (the playground does)."""
    merged: list[Piece] = []
    for piece in pieces:
        if merged and piece[1] is None and merged[-1][1] is None:
            merged[-1] = (merged[-1][0] + piece[0], None, piece[2])
        else:
            merged.append(piece)
    return merged


def decode_with_offsets(table: list[bytes], ids: list[int]) -> tuple[str, list[int]]:
    """The text ``ids`` decode to, and the character offset at which each id's text starts."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces, offsets, length = [], [], 0
    for token in ids:
        offsets.append(length)
        piece = decoder.decode(table[token])
        pieces.append(piece)
        length += len(piece)
    pieces.append(decoder.decode(b"", final=True))
    return "".join(pieces), offsets


class CompletionWriter:
    """Turns one job's events into pieces and pieces into OpenAI JSON."""

    OBJECT, CHUNK_OBJECT, ID_PREFIX = "text_completion", "text_completion", "cmpl"
    END = DONE  # the stream's last event

    def __init__(
        self, body: CompletionRequest, served: ServedModel, prompt_ids: list[int], index: int = 0
    ):
        self.body = body
        self.index = index  # the choice this writer writes
        self.prompt_ids = prompt_ids
        self.name: Callable[[int], str] = (
            (lambda token: f"token_id:{token}")
            if body.return_tokens_as_token_ids
            else served.token_strings.__getitem__
        )
        self.prompt_text = ""
        self.prompt_offsets: list[int] = []
        if body.echo:
            self.prompt_text, self.prompt_offsets = decode_with_offsets(
                served.token_bytes, prompt_ids
            )
        self.offset = len(self.prompt_text)  # text_offset of the next generated token
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the engine reused from its prefix cache
        self.queue_time = 0.0  # seconds the job waited in the engine's queue
        self.first_token_at: float | None = None  # time.monotonic() when its first token came
        self.id, self.created = f"{self.ID_PREFIX}-{uuid.uuid4().hex}", int(time.time())
        self.model = served.name
        # One chunk dict reused for every event: only the choice's fields change.
        self._choice: dict[str, Any] = {
            "index": index,
            "text": "",
            "logprobs": None,
            "finish_reason": None,
        }
        self._chunk = self._envelope([self._choice])
        if body.include_usage:
            self._chunk["usage"] = None

    async def read(self, job: Job | None) -> AsyncIterator[list[Piece]]:
        """The response's pieces, in batches as they arrive (a batch's pieces :func:`joined`).
        Raises a Failure's APIError."""
        if job is None:
            yield [(self.prompt_text, None, "length")]
            return
        if self.body.echo and not job.score_prompt:
            yield [(self.prompt_text, None, None)]
        while True:
            pieces: list[Piece] = []
            for event in await job.next_events():
                if isinstance(event, Failure):
                    if pieces:  # tokens that arrived with the failure still reach the client
                        yield joined(pieces)
                    raise event.error
                if isinstance(event, Token):
                    piece = self._token_piece(event)
                else:
                    piece = self._prompt_piece(event, final=not job.generates)
                pieces.append(piece)
                if piece[2] is not None:  # the job's last event
                    job.closed = True
                    yield joined(pieces)
                    return
            yield joined(pieces)

    def _count(self, event: Token) -> None:
        """Count a generated token; its first brings the prompt's cached tokens and its time in
        the engine's queue, and is when the first token arrived (a trace's span reads them)."""
        if not self.completion_tokens:
            self.cached_tokens, self.queue_time = event.cached_tokens, event.queue_time
            self.first_token_at = time.monotonic()
        self.completion_tokens += 1

    def _token_piece(self, event: Token) -> Piece:
        self._count(event)
        logprobs: Logprobs | None = None
        if event.logprob is not None:
            logprobs = {
                "tokens": [self.name(event.token)],
                "token_logprobs": [event.logprob],
                "top_logprobs": [self._top(event.top_ids or [], event.top_values or [])],
                "text_offset": [self.offset],
            }
        self.offset += len(event.text)
        return event.text, logprobs, event.finish_reason

    def _prompt_piece(self, scores: Scores, final: bool) -> Piece:
        """The echoed prompt with its logprobs; its first token has none (nothing precedes it)."""
        tops = map(self._top, scores.top_ids, scores.top_values)
        logprobs: Logprobs = {
            "tokens": [self.name(token) for token in self.prompt_ids],
            "token_logprobs": [None, *scores.logprobs],
            "top_logprobs": [None, *tops],
            "text_offset": self.prompt_offsets,
        }
        return self.prompt_text, logprobs, "length" if final else None

    def _top(self, ids: list[int], values: list[float]) -> dict[str, float]:
        return dict(zip(map(self.name, ids), values, strict=True))

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.CHUNK_OBJECT if self.body.stream else self.OBJECT,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage(self) -> dict[str, Any]:
        return total_usage([self])

    def error_event(self, error: APIError) -> bytes:
        """The event that ends this stream when it fails after it started."""
        return error_event(error)

    def chunk(self, piece: Piece, usage: dict[str, Any] | None = None) -> bytes:
        """One SSE event for ``piece``; ``usage``: the request's so far, when every chunk
        carries it (continuous_usage_stats)."""
        choice = self._choice
        choice["text"], choice["logprobs"], choice["finish_reason"] = piece
        if usage is not None:
            self._chunk["usage"] = usage
        return sse_event(self._chunk)

    def combine(
        self, results: list[dict[str, Any]], writers: Sequence[CompletionWriter]
    ) -> dict[str, Any]:
        """The non-stream response of a request whose choices are ``writers``' ``results``."""
        return combine(results, writers)

    def usage_chunk(self, usage: dict[str, Any]) -> bytes:
        chunk = {**self._envelope([]), "usage": usage}
        return sse_event(chunk)

    def result(self, pieces: list[Piece]) -> dict[str, Any]:
        """The non-stream response: every piece joined."""
        logprobs: Logprobs | None = None
        for _, part, _ in pieces:
            if part is not None:
                logprobs = logprobs or {key: [] for key in part}
                for key, values in part.items():
                    logprobs[key].extend(values)
        text = "".join(text for text, _, _ in pieces)
        choice = {
            "index": self.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": pieces[-1][2],
        }
        return {**self._envelope([choice]), "usage": self.usage()}


class ChatWriter(CompletionWriter):
    """The same pieces in OpenAI's chat format: ``chat.completion`` with a ``message``, or
    ``chat.completion.chunk`` events whose ``delta`` carries the role first, then the text."""

    OBJECT, CHUNK_OBJECT, ID_PREFIX = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def __init__(
        self, body: CompletionRequest, served: ServedModel, prompt_ids: list[int], index: int = 0
    ):
        super().__init__(body, served, prompt_ids, index)
        self.token_bytes = served.token_bytes
        self._role_sent = False

    def _token_piece(self, event: Token) -> Piece:
        self._count(event)
        logprobs: Logprobs | None = None
        if event.logprob is not None:
            top = zip(event.top_ids or [], event.top_values or [], strict=True)
            entry = self._entry(event.token, event.logprob)
            entry["top_logprobs"] = [self._entry(token, value) for token, value in top]
            logprobs = {"content": [entry]}
        return event.text, logprobs, event.finish_reason

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self.name(token),
            "logprob": logprob,
            "bytes": list(self.token_bytes[token]),
        }

    def chunk(self, piece: Piece, usage: dict[str, Any] | None = None) -> bytes:
        text, logprobs, finish_reason = piece
        delta: dict[str, Any] = {"content": text} if text or not finish_reason else {}
        if not self._role_sent:
            delta, self._role_sent = {"role": "assistant", **delta}, True
        return self._delta_event(delta, logprobs, finish_reason, usage)

    def _delta_event(
        self,
        delta: dict[str, Any],
        logprobs: Logprobs | None,
        finish_reason: str | None,
        usage: dict[str, int] | None,
    ) -> bytes:
        """One ``chat.completion.chunk`` event of this choice carrying ``delta``."""
        choice = {
            "index": self.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        chunk = self._envelope([choice])
        if self.body.include_usage:
            chunk["usage"] = usage
        return sse_event(chunk)

    def result(self, pieces: list[Piece]) -> dict[str, Any]:
        content = [entry for _, part, _ in pieces if part for entry in part["content"]]
        choice = {
            "index": self.index,
            "message": {"role": "assistant", "content": "".join(text for text, _, _ in pieces)},
            "logprobs": {"content": content} if self.body.logprobs is not None else None,
            "finish_reason": pieces[-1][2],
        }
        return {**self._envelope([choice]), "usage": self.usage()}


def total_usage(writers: Sequence[CompletionWriter]) -> dict[str, Any]:
    """A request's usage over its choices: each prompt counted once (its n choices share it,
    as OpenAI counts them, and so do its cached tokens: those of the choice that reused the
    most), every choice's tokens."""
    n = min(writers[0].body.n, len(writers))
    prompts = [writers[start : start + n] for start in range(0, len(writers), n)]
    prompt = sum(len(choices[0].prompt_ids) for choices in prompts)
    cached = sum(max(writer.cached_tokens for writer in choices) for choices in prompts)
    completion = sum(writer.completion_tokens for writer in writers)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def combine(results: list[dict[str, Any]], writers: Sequence[CompletionWriter]) -> dict[str, Any]:
    """One non-stream response from each choice's: the first's envelope, every choice."""
    choices = [result["choices"][0] for result in results]
    return {**results[0], "choices": choices, "usage": total_usage(writers)}
