"""The HTTP endpoints. Handlers stay thin: the work is in ``server.api.completions`` and the
engine."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import PlainTextResponse, Response

from model.tokenizer import BOS, EOS, PAD
from server.api.anthropic import CountTokensRequest, MessagesRequest, count_tokens, create_message
from server.api.chat import create_chat_completion
from server.api.completions import create_completion
from server.api.embeddings import EmbeddingRequest, create_embeddings
from server.api.errors import APIError, busy, error_responses
from server.api.offload import tokenised
from server.api.responses import create_response
from server.api.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    HealthDocument,
    ResponsesRequest,
    TokenizeRequest,
)
from server.api.service import ServedModel, Service

router = APIRouter()

# One event of a streamed completion, as OpenAPI 3.1 describes an event stream's events.
SSE_EVENT = {
    "type": "object",
    "properties": {
        "data": {
            "type": "string",
            "description": "a completion chunk (JSON), an error body (JSON), or [DONE]",
        }
    },
    "required": ["data"],
}


UNHEALTHY = {  # /health's message for each status that is not serving
    "loading": "the models are still loading",
    "failed": "no model could be loaded",
    "stalled": "the engine has stopped stepping while work waits; it is being restarted",
}


def _service(request: Request) -> Service:
    return request.app.state.service


def _json(data: Any) -> Response:
    return Response(orjson.dumps(data), media_type="application/json")


@router.get(
    "/health",
    response_model=None,
    responses={200: {"model": HealthDocument}, **error_responses(503)},
)
async def health(request: Request) -> Response:
    """200 while at least one model serves; 503 before (or if none could load), and while the
    engine has stalled (no step for ``engine_stall_timeout`` s while work waits). The body gives
    every model's state: loading, ready, or failed with the reason."""
    service = _service(request)
    ready, document = service.health()
    if ready:
        return _json(document)
    error = busy(service.load_error or UNHEALTHY[document["status"]], status=503)
    return Response(
        orjson.dumps({**error.body(), **document}),
        status_code=503,
        headers=error.headers,
        media_type="application/json",
    )


@router.get("/metrics", response_class=PlainTextResponse, responses=error_responses(401))
async def metrics(request: Request) -> Response:
    return Response(_service(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", response_model=None, responses=error_responses(401, 503))
async def list_models(request: Request) -> Response:
    service = _service(request)
    if not service.ready:
        service.get(None)  # raises the 503 that says why
    models = [
        {**served.describe(), "default": name == service.default_model}
        for name, served in service.models.items()
    ]
    return _json({"object": "list", "data": models})


@router.post("/v1/models/reload", response_model=None, responses=error_responses(401, 503))
async def reload_models(request: Request) -> Response:
    """Look at the checkpoints folder now, as the watcher does every ``--watch-interval``, but
    acting at once: new and changed folders load, removed ones are unloaded, incomplete ones
    are reported. Answers once the loads it started have ended: what loaded, what failed and
    why, what was unloaded, and the models served."""
    service = _service(request)
    if service.engine is None:
        raise busy(service.load_error or "the server is starting", status=503)
    return _json(await service.reload())


@router.get("/v1/models/{model_id}", response_model=None, responses=error_responses(401, 404, 503))
async def get_model(model_id: str, request: Request) -> Response:
    service = _service(request)
    served = service.get(model_id)
    return _json({**served.describe(), "default": served.name == service.default_model})


@router.post(
    "/v1/tokenize", response_model=None, responses=error_responses(400, 401, 404, 413, 503)
)
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    """The ids a prompt becomes in a completion (``<|bos|>`` first unless
    ``add_special_tokens`` is false), with the model's ``max_context``."""
    served = _service(request).get(body.model)
    bos = served.bos if body.add_special_tokens else None
    ids = await tokenised(served.tokenizer, body.prompt, bos)
    limit = served.max_context
    answer = {"model": served.name, "tokens": ids, "count": len(ids), "max_context": limit}
    return _json(answer | _token_strs(served, ids, body.return_token_strs))


@router.post("/tokenize", response_model=None, responses=error_responses(400, 401, 404, 413, 503))
async def tokenize_vllm(body: TokenizeRequest, request: Request) -> Response:
    """vLLM's ``/tokenize``, in its shapes (``count``, ``max_model_len``, ``tokens``,
    ``token_strs``), for clients that find the tokenizer there (lm-evaluation-harness's remote
    tokenizer). As vLLM's (Hugging Face's) tokenizers do, a special token's name in the text is
    that token, so a client finds ``<|bos|>``'s id by tokenising its name; a completion's text
    prompt never reads them (``/v1/tokenize``). Any other text gives ``/v1/tokenize``'s ids."""
    served = _service(request).get(body.model)
    bos = served.bos if body.add_special_tokens else None
    ids = await tokenised(served.tokenizer, body.prompt, bos, served.special_names)
    answer = {"count": len(ids), "max_model_len": served.max_context, "tokens": ids}
    return _json(answer | _token_strs(served, ids, body.return_token_strs, always=True))


def _token_strs(
    served: ServedModel, ids: list[int], wanted: bool | None, always: bool = False
) -> dict[str, list[str] | None]:
    """vLLM's ``token_strs`` (the vocabulary's own strings) when ``wanted``; ``always``: null
    when not, as vLLM answers."""
    if wanted:
        return {"token_strs": [served.tokenizer.id_to_token(token) or "" for token in ids]}
    return {"token_strs": None} if always else {}


@router.post(
    "/v1/detokenize", response_model=None, responses=error_responses(400, 401, 404, 413, 503)
)
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    """The text token ids stand for (special tokens have none), as vLLM's /detokenize."""
    served, text = _detokenized(body, request)
    return _json({"model": served.name, "prompt": text})


@router.post("/detokenize", response_model=None, responses=error_responses(400, 401, 404, 413, 503))
async def detokenize_vllm(body: DetokenizeRequest, request: Request) -> Response:
    """vLLM's ``/detokenize``, in its shape: ``{"prompt": text}``."""
    return _json({"prompt": _detokenized(body, request)[1]})


def _detokenized(body: DetokenizeRequest, request: Request) -> tuple[ServedModel, str]:
    served = _service(request).get(body.model)
    outside = [token for token in body.tokens if token >= served.vocab]
    if outside:
        raise APIError(
            400,
            f"tokens: id {outside[0]} is outside model '{served.name}''s vocabulary "
            f"[0, {served.vocab})",
            param="tokens",
        )
    return served, b"".join(served.token_bytes[t] for t in body.tokens).decode("utf-8", "replace")


@router.get("/tokenizer_info", response_model=None, responses=error_responses(401, 404, 503))
async def tokenizer_info(request: Request, model: str | None = None) -> Response:
    """The tokenizer's configuration as vLLM's ``/tokenizer_info`` gives it (Hugging Face's
    ``tokenizer_config.json`` keys: what a client needs to tokenize and template as the server
    does, e.g. lm-evaluation-harness's remote tokenizer); ``?model=`` picks the model."""
    served = _service(request).get(model)
    return _json(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "add_bos_token": True,  # to a text prompt; token ids are used as given
            "model_max_length": served.max_context,
            "vocab_size": served.vocab,
            "chat_template": served.chat_template.source,
        }
    )


GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {"schema": SSE_EVENT}}},
    **error_responses(400, 401, 403, 404, 413, 429, 500, 503, 504),
}


@router.post("/v1/completions", response_model=None, responses=GENERATION_RESPONSES)
async def completions(body: CompletionRequest, request: Request) -> Response:
    service = _service(request)
    service.priorities.check(body.priority, request.headers)
    return await create_completion(body, request, service)


@router.post("/v1/chat/completions", response_model=None, responses=GENERATION_RESPONSES)
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    service = _service(request)
    service.priorities.check(body.priority, request.headers)
    return await create_chat_completion(body, request, service)


@router.post("/v1/responses", response_model=None, responses=GENERATION_RESPONSES)
async def responses(body: ResponsesRequest, request: Request) -> Response:
    """OpenAI's Responses API, stateless (``server.api.responses``)."""
    service = _service(request)
    service.priorities.check(body.priority, request.headers)
    return await create_response(body, request, service)


# One event of a streamed Anthropic message: its type names it (``event: TYPE``) and its JSON.
ANTHROPIC_EVENT = {
    "type": "object",
    "properties": {
        "event": {"type": "string", "description": "message_start, content_block_start, ..."},
        "data": {"type": "string", "description": "the event (JSON), with the same type"},
    },
    "required": ["event", "data"],
}


@router.post(
    "/v1/messages",
    response_model=None,
    responses={
        200: {"content": {"text/event-stream": {"schema": ANTHROPIC_EVENT}}},
        **error_responses(400, 401, 403, 404, 413, 429, 500, 503, 504, anthropic=True),
    },
)
async def messages(body: MessagesRequest, request: Request) -> Response:
    """Anthropic's Messages API, over the chat path (``server.api.anthropic``)."""
    service = _service(request)
    service.priorities.check(body.priority, request.headers)
    return await create_message(body, request, service)


@router.post(
    "/v1/messages/count_tokens",
    response_model=None,
    responses=error_responses(400, 401, 404, 413, 503, anthropic=True),
)
async def messages_count_tokens(body: CountTokensRequest, request: Request) -> Response:
    """The tokens a Messages request's prompt takes (its usage's input and cache-read tokens)."""
    return _json(await count_tokens(body, _service(request)))


@router.post(
    "/v1/embeddings",
    response_model=None,
    responses=error_responses(400, 401, 404, 413, 429, 503),
)
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    """OpenAI's embeddings: each input's hidden state (``layer``: which residual stream,
    default the final norm's output; ``pooling``: mean or last), from a forward pass in the
    engine (``server.api.embeddings``)."""
    served = _service(request).get(body.model)
    answer, tokens = await create_embeddings(body, served)
    if (span := getattr(request.state, "span", None)) is not None:  # tracing is on
        span.model(served.name)
        span.usage(tokens)
    return Response(answer, media_type="application/json")
