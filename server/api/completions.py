"""``POST /v1/completions``: a validated request → a Job → OpenAI-shaped JSON or SSE chunks.

The model-dependent checks (prompt length, room for max_tokens, token ids) happen here, before
anything reaches an engine. Whatever way a request ends (done, error, timeout, the client
leaving), its job is cancelled, which frees its row.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, NamedTuple

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from model.tokenizer import encode_prompt
from server.api.errors import APIError, too_long
from server.api.job import Job
from server.api.metrics import TIMEOUT
from server.api.offload import check_prompt_size, tokenised
from server.api.schemas import DEFAULT_MAX_TOKENS, MAX_CHOICES, CompletionRequest, Prompt
from server.api.service import ServedModel, Service
from server.api.structured import compile_constraint
from server.api.writer import CompletionWriter, Piece, total_usage

logger = logging.getLogger("ordinal.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def create_completion(
    body: CompletionRequest, request: Request, service: Service
) -> Response:
    """Answer one completion request (400/404/429/503 are raised as APIError).

    Each prompt of ``prompt`` gets ``n`` choices, choice ``index = prompt × n + j`` drawn with
    seed ``seed + j``: so choice 0 is what the same request with n = 1 returns.
    """
    served = service.get(body.model)
    prompts = body.prompts
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(
            400,
            f"n: {len(prompts)} prompts × n {body.n} is {len(prompts) * body.n} choices; at "
            f"most {MAX_CHOICES} per request",
            param="n",
        )
    grammar = await compile_constraint(body.constraint(), served)
    writers: list[CompletionWriter] = []
    jobs: list[Job | None] = []
    for prompt in prompts:
        prompt_ids = await prompt_ids_of(prompt, served)
        for j in range(body.n):
            job = build_job(body, served, prompt_ids, choice_seed(body.seed, j), grammar=grammar)
            writers.append(CompletionWriter(body, served, prompt_ids, index=len(writers)))
            jobs.append(job)
    return await respond(jobs, writers, served, request, service)


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice ``choice`` of a request seeded with ``seed``."""
    return None if seed is None else (seed + choice) % 2**64


async def respond(
    jobs: list[Job | None],
    writers: Sequence[CompletionWriter],  # read only: a list of ChatWriters fits too
    served: ServedModel,
    request: Request,
    service: Service,
) -> Response:
    """Run ``jobs`` (one per choice) and answer with what their ``writers`` make of the
    events: SSE chunks if the request streams, one JSON body if not. Completions and chat
    differ only in the writer."""
    closes: list[Callable[[], None]] = []
    try:
        for job in jobs:
            if job is not None:
                closes.append(_submit(job, served, service.settings.request_timeout))
    except APIError:  # the engine is full: the choices already queued leave with the request
        for close in closes:
            close()
        raise

    span = getattr(request.state, "span", None)  # a SpanRecord when tracing is on

    def close_all() -> None:
        for close in closes:
            close()
        if span is not None:
            span.generation(served.name, jobs, writers)

    streams = [writer.read(job) for writer, job in zip(writers, jobs, strict=True)]
    if writers[0].body.stream:
        return JobStreamingResponse(_sse(streams, writers), on_close=close_all)
    try:
        return await _until_disconnect(_collect(streams, writers), request)
    finally:
        close_all()


def _submit(job: Job, served: ServedModel, timeout: float) -> Callable[[], None]:
    """Hand ``job`` to its engine (429 when full); return what ends it, however it ends."""
    served.engine.submit(job)
    served.engine.metrics.request_max_num_generation_tokens.observe(job.max_tokens)

    def expire() -> None:
        served.engine.metrics.failures[TIMEOUT].inc()
        job.expire()

    timer = asyncio.get_running_loop().call_later(timeout, expire)

    def close() -> None:
        timer.cancel()
        served.engine.cancel(job)  # frees the row unless the job has already finished

    return close


class Names(NamedTuple):
    """How a request names its prompt and its token budget, in the 400s that point at them."""

    prompt: str = "prompt"  # the field
    prompt_text: str = "the prompt"  # how a message starts that says the prompt is too long
    max_tokens: str = "max_tokens"


COMPLETION_NAMES = Names()


def build_job(
    body: CompletionRequest,
    served: ServedModel,
    prompt_ids: list[int],
    seed: int | None,
    names: Names = COMPLETION_NAMES,
    grammar: str | None = None,
) -> Job | None:
    """The job to run for ``prompt_ids`` (None when there is nothing to compute); ``grammar``:
    the output's constraint, compiled (``server.api.structured``).

    Raises a 400 APIError when the prompt or max_tokens does not fit the model (``names``: the
    request's own names for them).
    """
    max_tokens = _max_tokens(body, served, len(prompt_ids), names)
    if max_tokens == 0 and body.logprobs is None:
        return None
    job = Job(
        prompt_ids,
        body.sampling_params(served.vocab, seed=seed, grammar=grammar),
        max_tokens=max_tokens,
        stop=body.stops,
        eos_id=None if body.ignore_eos else served.eos,
        logprobs=body.logprobs,
        score_prompt=body.echo and body.logprobs is not None,
        priority=body.priority,
    )
    return job


async def prompt_ids_of(prompt: Prompt, served: ServedModel, field: str = "prompt") -> list[int]:
    """The prompt's token ids: a text's with <|bos|> first, token ids as given (a 400 for
    none, or for an id outside the vocabulary); a text too long to fit the context is refused
    before it is tokenised, off the event loop. ``field``: where the request holds it, as a
    400 names it (``input[2]``: its top-level field is the error's ``param``)."""
    param = field.split("[")[0]
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(
                400,
                f"{field}: an empty list of token ids gives the model nothing to start from "
                "(send <|bos|>'s id, or text)",
                param=param,
            )
        vocab = served.vocab
        if max(prompt) >= vocab:  # max(): one C pass over what may be thousands of ids
            outside = next(token for token in prompt if token >= vocab)
            raise APIError(
                400,
                f"{field}: token id {outside} is outside model '{served.name}''s vocabulary "
                f"[0, {vocab})",
                param=param,
            )
        return encode_prompt(served.tokenizer, prompt)
    check_prompt_size(prompt, served.max_prompt_bytes, served.name, field)
    return await tokenised(served.tokenizer, prompt, served.bos)


def _max_tokens(
    body: CompletionRequest, served: ServedModel, prompt_length: int, names: Names
) -> int:
    """The number of tokens to generate, checked against the room left in the context."""
    limit, scoring = served.max_context, body.max_tokens == 0
    allowed = limit if scoring else limit - 1  # generating needs room for one token at least
    if prompt_length > allowed:
        raise too_long(
            names.prompt_text,
            prompt_length,
            f"model '{served.name}'",
            allowed,
            names.prompt,
            f": its context holds {limit} tokens, prompt and completion together",
        )
    room = limit - prompt_length
    if body.max_tokens is None:
        return min(DEFAULT_MAX_TOKENS, room)
    if body.max_tokens > room:
        raise APIError(
            400,
            f"{names.max_tokens} is {body.max_tokens} but only {room} tokens are left after the "
            f"prompt's {prompt_length} in the {limit}-token context of model '{served.name}'",
            param=names.max_tokens,
            code="context_length_exceeded",
        )
    return body.max_tokens


async def _collect(
    streams: list[AsyncIterator[list[Piece]]], writers: Sequence[CompletionWriter]
) -> Response:
    async def pieces_of(stream: AsyncIterator[list[Piece]]) -> list[Piece]:
        return [piece async for batch in stream for piece in batch]

    collected = await asyncio.gather(*map(pieces_of, streams))
    results = [writer.result(pieces) for writer, pieces in zip(writers, collected, strict=True)]
    answer = writers[0].combine(results, writers)
    return Response(orjson.dumps(answer), media_type="application/json")


async def _sse(
    streams: list[AsyncIterator[list[Piece]]], writers: Sequence[CompletionWriter]
) -> AsyncIterator[bytes]:
    try:
        continuous = writers[0].body.continuous_usage
        async for index, batch in _interleave(streams):
            # the batch's tokens are all counted by now: its chunks carry the usage as it
            # stands when they are sent
            usage = total_usage(writers) if continuous else None
            yield b"".join(writers[index].chunk(piece, usage) for piece in batch)
        if writers[0].body.include_usage:
            yield writers[0].usage_chunk(total_usage(writers))
    except APIError as error:  # the headers are out: the error travels as the last event
        yield writers[0].error_event(error)
    except Exception:
        logger.exception("a stream failed")
        yield writers[0].error_event(APIError(500, "internal server error"))
    yield writers[0].END


async def _interleave(
    streams: list[AsyncIterator[list[Piece]]],
) -> AsyncIterator[tuple[int, list[Piece]]]:
    """(choice index, pieces) from every stream as they arrive; the first error ends them all."""
    if len(streams) == 1:
        async for pieces in streams[0]:
            yield 0, pieces
        return
    arrived: asyncio.Queue[tuple[int, list[Piece] | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[list[Piece]]) -> None:
        try:
            async for batch in stream:
                arrived.put_nowait((index, batch, None))
            arrived.put_nowait((index, None, None))
        except Exception as error:
            arrived.put_nowait((index, None, error))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, batch, error = await arrived.get()
            if error is not None:
                raise error
            if batch is None:
                running -= 1
            else:
                yield index, batch
    finally:
        for task in tasks:
            task.cancel()


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
