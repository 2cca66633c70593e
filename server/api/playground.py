"""The playground: ``GET /`` (one page), its static files, ``POST /v1/trace``, ``POST /v1/patch``
and the geometry reports (``GET /v1/geometry``, ``/v1/geometry/{corpus}``,
``/v1/geometry/{corpus}/{figure}``).

The page is plain HTML, CSS and JavaScript in ``server/static`` (no build step); its charts use
the vendored d3 and Observable Plot in ``server/static/vendor``. Nothing is fetched from the
network: the page talks only to this server's own endpoints (``/v1/models``,
``/v1/completions`` with streaming, ``/v1/tokenize``, ``/v1/trace``, ``/v1/patch``,
``/v1/geometry``).

The geometry routes serve, read-only, what ``ordinal geometry`` wrote into
:data:`GEOMETRY_REPORTS` (the committed ``docs/geometry/<corpus>/``): ``report.json`` byte for
byte and the PNG figures it lists, so the Encodings view shows the measured numbers, never
copies of them. They are routes rather than a static mount so that only a report and the figures
it names are reachable (not the folder's other files), and a missing report is a documented 404 in
the API's error shape.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

from server.api.errors import APIError, error_responses
from server.api.explain import PatchResponse, create_patch
from server.api.schemas import PatchRequest, TraceRequest
from server.api.service import Service
from server.api.trace import TraceResponse, create_trace

STATIC = Path(__file__).resolve().parents[1] / "static"  # server/static
# Where `ordinal geometry` reports live in a checkout: one folder per corpus.
GEOMETRY_REPORTS = Path(__file__).resolve().parents[2] / "docs" / "geometry"
REPORT_FILE = "report.json"  # lab.geometry.report.REPORT_FILE (not imported: matplotlib)

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
        **error_responses(400, 401, 404, 413, 429, 503),
    },
)
async def trace(body: TraceRequest, request: Request) -> Response:
    """One forward pass over ``prompt`` through the served model: its tokens, embeddings,
    every layer's attention, the positional bias or rotation, the next token's distribution
    after each sampling stage, and each prompt token's surprisal. At most 256 tokens (or the
    model's max_context if smaller), else a 400 ``context_length_exceeded``."""
    service: Service = request.app.state.service
    served = service.get(body.model)
    content = await create_trace(body, served)
    return Response(content, media_type="application/json")


@router.post(
    "/v1/patch",
    response_model=None,
    responses={
        200: {"model": PatchResponse, "description": "the effect of each stream and position"},
        **error_responses(400, 401, 404, 413, 429, 503),
    },
)
async def patch(body: PatchRequest, request: Request) -> Response:
    """Activation patching: for every residual stream (the embeddings, each layer's output)
    and position, run ``corrupted`` with that stream replaced by ``clean``'s there, and report
    how much of the target's clean − corrupted logit difference comes back. The prompts must
    tokenise to one length, at most 128 tokens (``server.api.explain``)."""
    service: Service = request.app.state.service
    served = service.get(body.model)
    content = await create_patch(body, served)
    return Response(content, media_type="application/json")


# ---- the geometry reports -----------------------------------------------------------------


class GeometryEntry(BaseModel):
    corpus: str = Field(description="the folder's name: synthetic or shakespeare")
    n_positions: int
    schemes: list[str] = Field(description="the labels of the schemes measured, in order")
    figures: list[str] = Field(description="PNG names, each at /v1/geometry/{corpus}/{figure}")


class GeometryList(BaseModel):
    object: str = "list"
    data: list[GeometryEntry]


def _report_path(corpus: str) -> Path:
    """report.json of ``corpus``, or a 404 when no such report was written."""
    path = GEOMETRY_REPORTS / corpus / REPORT_FILE
    if corpus not in _corpora() or not path.is_file():
        raise APIError(
            404,
            f"no geometry report for corpus '{corpus}' (have: {', '.join(_corpora()) or 'none'}; "
            f"`ordinal geometry --corpus {corpus} --out docs/geometry/{corpus}` writes one)",
            param="corpus",
            code="report_not_found",
        )
    return path


def _corpora() -> list[str]:
    if not GEOMETRY_REPORTS.is_dir():
        return []
    return sorted(p.parent.name for p in GEOMETRY_REPORTS.glob(f"*/{REPORT_FILE}"))


def _read_report(corpus: str) -> dict[str, Any]:
    return orjson.loads(_report_path(corpus).read_bytes())


@router.get(
    "/v1/geometry",
    response_model=GeometryList,
    responses=error_responses(401),
)
async def geometry_reports() -> GeometryList:
    """The geometry reports this server has (``ordinal geometry``'s, one per corpus)."""
    entries = []
    for corpus in _corpora():
        report = _read_report(corpus)
        entries.append(
            GeometryEntry(
                corpus=corpus,
                n_positions=report["corpus"]["n_positions"],
                schemes=[row["label"] for row in report["schemes"]],
                figures=report["figures"],
            )
        )
    return GeometryList(data=entries)


@router.get(
    "/v1/geometry/{corpus}",
    response_model=None,
    responses={
        200: {
            "description": "report.json as `ordinal geometry` wrote it (lab/geometry/report.py"
            " documents its fields: corpus, hellinger, mds, rank_stress_table, schemes, "
            "requirements, figures, and paper_comparison for synthetic)",
            "content": {"application/json": {"schema": {"type": "object"}}},
        },
        **error_responses(401, 404),
    },
)
async def geometry_report(corpus: str) -> FileResponse:
    """The geometry report of ``corpus``, byte for byte."""
    return FileResponse(_report_path(corpus), media_type="application/json")


@router.get(
    "/v1/geometry/{corpus}/{figure}",
    response_model=None,
    responses={
        200: {"description": "the PNG", "content": {"image/png": {}}},
        **error_responses(401, 404),
    },
)
async def geometry_figure(corpus: str, figure: str) -> FileResponse:
    """One figure of the report of ``corpus``: only a name its ``figures`` lists."""
    figures = _read_report(corpus)["figures"]
    if figure not in figures:
        raise APIError(
            404,
            f"the {corpus} report has no figure '{figure}' (it has: {', '.join(figures)})",
            param="figure",
            code="figure_not_found",
        )
    return FileResponse(GEOMETRY_REPORTS / corpus / figure, media_type="image/png")
