"""The HTTP endpoints. Handlers stay thin: the work is in ``server.completions`` and the engine."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from model.generate import encode_prompt
from server.completions import create_completion
from server.errors import busy
from server.schemas import CompletionRequest, TokenizeRequest
from server.service import Service

router = APIRouter()


def _service(request: Request) -> Service:
    return request.app.state.service


def _json(data: Any) -> Response:
    return Response(orjson.dumps(data), media_type="application/json")


@router.get("/health")
async def health(request: Request) -> Response:
    """200 once every model is loaded and its engine running; 503 before (or if loading failed)."""
    service = _service(request)
    if not service.ready:
        raise busy(service.load_error or "the models are still loading", status=503)
    return _json({"status": "ok", "models": list(service.models)})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_service(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    service = _service(request)
    service.get(None)  # 503 while loading
    models = [
        {**served.describe(), "default": name == service.default_model}
        for name, served in service.models.items()
    ]
    return _json({"object": "list", "data": models})


@router.post("/v1/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    served = _service(request).get(body.model)
    tokenizer = served.tokenizer
    if body.add_special_tokens:
        ids = encode_prompt(tokenizer, body.prompt)
    else:
        ids = tokenizer.encode(body.prompt).ids
    limit = served.max_context
    return _json({"model": served.name, "tokens": ids, "count": len(ids), "max_model_len": limit})


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await create_completion(body, request, _service(request))
