"""``POST /v1/completions``: a validated request → a Job → OpenAI-shaped JSON or SSE chunks.

The response is a sequence of *pieces* (text, logprobs, finish_reason): the echoed prompt
first if asked for, then one piece per generated token. A stream sends each piece as one
``data: {chunk}`` event; the non-stream answer joins them.
"""

from __future__ import annotations

import asyncio
import codecs
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from model.generate import SequenceState, StopMatcher, encode_prompt
from model.sampling import SamplingParams
from model.tokenizer import IncrementalDecoder
from server.errors import APIError, error_event
from server.job import Failure, Job, PromptScores, TokenEvent
from server.schemas import DEFAULT_MAX_TOKENS, CompletionRequest
from server.service import ServedModel, Service

Logprobs = dict[str, list[Any]]
Piece = tuple[str, Logprobs | None, str | None]  # text, logprobs, finish_reason
DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def create_completion(
    body: CompletionRequest, request: Request, service: Service
) -> Response:
    """Answer one completion request (400/404/429/503 are raised as APIError)."""
    served = service.get(body.model)
    prompt_ids, job = build_job(body, served)
    writer = CompletionWriter(body, served, prompt_ids)
    close = _submit(job, served, service.settings.request_timeout) if job else _nothing
    pieces = writer.read(job)
    if body.stream:
        return JobStreamingResponse(_sse(pieces, writer), on_close=close)
    try:
        return await _until_disconnect(_collect(pieces, writer), request)
    finally:
        close()


def _submit(job: Job, served: ServedModel, timeout: float) -> Callable[[], None]:
    """Hand ``job`` to its engine (429 when full); return what ends it, however it ends."""
    served.engine.submit(job)
    timer = asyncio.get_running_loop().call_later(timeout, job.expire)

    def close() -> None:
        timer.cancel()
        served.engine.cancel(job)  # frees the row unless the job has already finished

    return close


def _nothing() -> None:
    pass


def build_job(body: CompletionRequest, served: ServedModel) -> tuple[list[int], Job | None]:
    """The prompt's token ids and the job to run (None when there is nothing to compute).

    Raises a 400 APIError when the prompt or max_tokens does not fit the model.
    """
    prompt_ids = _prompt_ids(body, served)
    max_tokens = _max_tokens(body, served, len(prompt_ids))
    if max_tokens == 0 and body.logprobs is None:
        return prompt_ids, None
    state = None
    if max_tokens > 0:
        state = SequenceState(
            prompt_ids=prompt_ids,
            max_new_tokens=max_tokens,
            decoder=IncrementalDecoder(served.tokenizer, served.token_bytes),
            stop=StopMatcher(body.stops),
            eos_id=served.eos,
        )
    params = SamplingParams(
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
    )
    score_prompt = body.echo and body.logprobs is not None
    return prompt_ids, Job(prompt_ids, state, params, body.logprobs, score_prompt)


def _prompt_ids(body: CompletionRequest, served: ServedModel) -> list[int]:
    if isinstance(body.prompt, list):
        outside = [token for token in body.prompt if token >= served.vocab]
        if outside:
            raise APIError(
                400,
                f"prompt: token id {outside[0]} is outside model '{served.name}''s vocabulary "
                f"[0, {served.vocab})",
                param="prompt",
            )
    return encode_prompt(served.tokenizer, body.prompt)


def _max_tokens(body: CompletionRequest, served: ServedModel, prompt_length: int) -> int:
    """The number of tokens to generate, checked against the room left in the context."""
    limit, scoring = served.max_context, body.max_tokens == 0
    allowed = limit if scoring else limit - 1  # generating needs room for one token at least
    if prompt_length > allowed:
        raise APIError(
            400,
            f"the prompt is {prompt_length} tokens long (counting <|bos|>) but model "
            f"'{served.name}' takes at most {allowed}: its context holds {limit} tokens, "
            "prompt and completion together",
            param="prompt",
            code="context_length_exceeded",
        )
    room = limit - prompt_length
    if body.max_tokens is None:
        return min(DEFAULT_MAX_TOKENS, room)
    if body.max_tokens > room:
        raise APIError(
            400,
            f"max_tokens is {body.max_tokens} but only {room} tokens are left in model "
            f"'{served.name}''s context of {limit} after the prompt's {prompt_length}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return body.max_tokens


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

    def __init__(self, body: CompletionRequest, served: ServedModel, prompt_ids: list[int]):
        self.body = body
        self.prompt_ids = prompt_ids
        self.name: Callable[[int], str] = (
            (lambda token: f"token_id:{token}")
            if body.return_tokens_as_token_ids
            else served.token_strings.__getitem__
        )
        self.prompt_text, self.prompt_offsets = "", []
        if body.echo:
            self.prompt_text, self.prompt_offsets = decode_with_offsets(
                served.token_bytes, prompt_ids
            )
        self.offset = len(self.prompt_text)  # text_offset of the next generated token
        self.completion_tokens = 0
        self.id, self.created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self.model = served.name
        # One chunk dict reused for every event: only the choice's fields change.
        self._choice: dict[str, Any] = {"index": 0, "text": "", "logprobs": None}
        self._choice["finish_reason"] = None
        self._chunk = self._envelope([self._choice])
        if body.include_usage:
            self._chunk["usage"] = None

    async def read(self, job: Job | None) -> AsyncIterator[list[Piece]]:
        """The response's pieces, in batches as they arrive. Raises a Failure's APIError."""
        if job is None:
            yield [(self.prompt_text, None, "length")]
            return
        if self.body.echo and not job.score_prompt:
            yield [(self.prompt_text, None, None)]
        while True:
            pieces: list[Piece] = []
            for event in await job.next_events():
                if isinstance(event, Failure):
                    raise event.error
                if isinstance(event, TokenEvent):
                    piece = self._token_piece(event)
                else:
                    piece = self._prompt_piece(event, final=job.state is None)
                pieces.append(piece)
                if piece[2] is not None:  # the job's last event
                    job.closed = True
                    yield pieces
                    return
            yield pieces

    def _token_piece(self, event: TokenEvent) -> Piece:
        self.completion_tokens += 1
        logprobs = None
        if event.logprob is not None:
            logprobs = {
                "tokens": [self.name(event.token)],
                "token_logprobs": [event.logprob],
                "top_logprobs": [self._top(event.top_ids or [], event.top_values or [])],
                "text_offset": [self.offset],
            }
        self.offset += len(event.text)
        return event.text, logprobs, event.finish_reason

    def _prompt_piece(self, scores: PromptScores, final: bool) -> Piece:
        """The echoed prompt with its logprobs; its first token has none (nothing precedes it)."""
        tops = map(self._top, scores.top_ids, scores.top_values)
        logprobs = {
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
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage(self) -> dict[str, int]:
        prompt = len(self.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
        }

    def chunk(self, piece: Piece) -> bytes:
        """One SSE event for ``piece``."""
        choice = self._choice
        choice["text"], choice["logprobs"], choice["finish_reason"] = piece
        return b"data: " + orjson.dumps(self._chunk) + b"\n\n"

    def usage_chunk(self) -> bytes:
        chunk = {**self._envelope([]), "usage": self.usage()}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def result(self, pieces: list[Piece]) -> dict[str, Any]:
        """The non-stream response: every piece joined."""
        logprobs: Logprobs | None = None
        for _, part, _ in pieces:
            if part is not None:
                logprobs = logprobs or {key: [] for key in part}
                for key, values in part.items():
                    logprobs[key].extend(values)
        text = "".join(text for text, _, _ in pieces)
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": pieces[-1][2]}
        return {**self._envelope([choice]), "usage": self.usage()}


async def _collect(pieces: AsyncIterator[list[Piece]], writer: CompletionWriter) -> Response:
    collected = [piece async for batch in pieces for piece in batch]
    return Response(orjson.dumps(writer.result(collected)), media_type="application/json")


async def _sse(
    pieces: AsyncIterator[list[Piece]], writer: CompletionWriter
) -> AsyncIterator[bytes]:
    try:
        async for batch in pieces:
            yield b"".join(map(writer.chunk, batch))
        if writer.body.include_usage:
            yield writer.usage_chunk()
    except APIError as error:  # the headers are out: the error travels as the last event
        yield error_event(error)
    yield DONE


class JobStreamingResponse(StreamingResponse):
    """A StreamingResponse that calls ``on_close`` however it ends (done, error, disconnect),
    even if the client left before the body started, so the job's row is always freed."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _until_disconnect(work: Any, request: Request) -> Response:
    """Await ``work``; if the client disconnects first, cancel it (its ``finally`` frees the job).

    After the body is read, the next ASGI message is ``http.disconnect`` — it arrives only if the
    client leaves (or the response is done, which cannot happen before ``work`` finishes).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if not task.done():
        task.cancel()
        return Response(status_code=499)  # nobody will read it
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
