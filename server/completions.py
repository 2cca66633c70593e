"""``POST /v1/completions``: a validated request → a Job → OpenAI-shaped JSON or SSE chunks.

The model-dependent checks (prompt length, room for max_tokens, token ids) happen here, before
anything reaches an engine. Whatever way a request ends (done, error, timeout, the client
leaving), its job is cancelled, which frees its row.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from model.generate import SequenceState, StopMatcher, encode_prompt
from model.tokenizer import IncrementalDecoder
from server.errors import APIError, error_event
from server.job import Job
from server.metrics import TIMEOUT
from server.schemas import DEFAULT_MAX_TOKENS, CompletionRequest, PromptRequest
from server.service import ServedModel, Service
from server.writer import CompletionWriter, Piece

logger = logging.getLogger("ordinal.server")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def create_completion(
    body: CompletionRequest, request: Request, service: Service
) -> Response:
    """Answer one completion request (400/404/429/503 are raised as APIError)."""
    served = service.get(body.model)
    prompt_ids, job = build_job(body, served)
    writer = CompletionWriter(body, served, prompt_ids)
    return await respond(job, writer, served, request, service)


async def respond(
    job: Job | None,
    writer: CompletionWriter,
    served: ServedModel,
    request: Request,
    service: Service,
) -> Response:
    """Run ``job`` and answer with what ``writer`` makes of its events: SSE chunks if the
    request streams, one JSON body if not. Completions and chat differ only in the writer."""
    close = _submit(job, served, service.settings.request_timeout) if job else _nothing
    pieces = writer.read(job)
    if writer.body.stream:
        return JobStreamingResponse(_sse(pieces, writer), on_close=close)
    try:
        return await _until_disconnect(_collect(pieces, writer), request)
    finally:
        close()


def _submit(job: Job, served: ServedModel, timeout: float) -> Callable[[], None]:
    """Hand ``job`` to its engine (429 when full); return what ends it, however it ends."""
    served.engine.submit(job)

    def expire() -> None:
        served.engine.metrics.failures[TIMEOUT].inc()
        job.expire()

    timer = asyncio.get_running_loop().call_later(timeout, expire)

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
    prompt_ids = prompt_ids_of(body, served)
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
            eos_id=None if body.ignore_eos else served.eos,
        )
    params = body.sampling_params(served.vocab, seed=body.seed)
    score_prompt = body.echo and body.logprobs is not None
    return prompt_ids, Job(prompt_ids, state, params, body.logprobs, score_prompt)


def prompt_ids_of(body: PromptRequest, served: ServedModel) -> list[int]:
    """The prompt's token ids with <|bos|>; a 400 for an id outside the vocabulary."""
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
            f"max_tokens is {body.max_tokens} but only {room} tokens are left after the "
            f"prompt's {prompt_length} in the {limit}-token context of model '{served.name}'",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return body.max_tokens


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
    except Exception:
        logger.exception("a stream failed")
        yield error_event(APIError(500, "internal server error"))
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
    """Await ``work``; if the client disconnects first, cancel it (the caller frees the job).

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
