"""The playground: ``GET /`` (one page), its static files, and ``POST /v1/trace``.

The page is plain HTML, CSS and JavaScript in ``server/static`` (no build step); its charts use
the vendored d3 and Observable Plot in ``server/static/vendor``. Nothing is fetched from the
network: the page talks only to this server's own endpoints (``/v1/models``,
``/v1/completions`` with streaming, ``/v1/trace``).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

from server.errors import error_responses
from server.schemas import TraceRequest
from server.service import Service
from server.trace import TraceResponse, create_trace

STATIC = Path(__file__).parent / "static"

router = APIRouter()


def static_files() -> StaticFiles:
    """The app mounts this at ``/static``."""
    return StaticFiles(directory=STATIC)


@router.get("/", include_in_schema=False)
async def playground() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


@router.post(
    "/v1/trace",
    response_model=None,
    responses={
        200: {"model": TraceResponse, "description": "the trace"},
        **error_responses(400, 401, 404, 413, 503),
    },
)
async def trace(body: TraceRequest, request: Request) -> Response:
    """One forward pass over ``prompt`` through the served model: its tokens, embeddings,
    every layer's attention, the positional bias or rotation, the next token's distribution
    after each sampling stage, and each prompt token's surprisal. At most 256 tokens (or the
    model's max_context if smaller), else a 400 ``context_length_exceeded``."""
    service: Service = request.app.state.service
    served = service.get(body.model)
    content = await create_trace(body, served, service.settings.threads)
    return Response(content, media_type="application/json")
