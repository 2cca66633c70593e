"""The FastAPI app (``create_app``) and ``ordinal serve`` (``run``; its flags: ``ordinal.py``)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from pydantic import ValidationError
from starlette.middleware.gzip import GZipMiddleware

from server.api.client import Launcher
from server.api.connections import guarded_protocol
from server.api.errors import document_errors, install_error_handlers
from server.api.middleware import (
    AllowHosts,
    CatchUnexpected,
    CountRequests,
    LimitBody,
    RequireApiKey,
)
from server.api.playground import router as playground_router
from server.api.playground import static_files
from server.api.routes import router
from server.api.service import Service, check_settings
from server.api.settings import Settings
from server.api.tracing import TraceRequests, Tracing


def create_app(settings: Settings | None = None, launcher: Launcher | None = None) -> FastAPI:
    """An app serving ``settings``' checkpoints. Models load in the engine process once it
    starts: ``/health`` is 503 until one is loaded, 200 after. ``launcher``: what the engine
    process runs (the tests' reaches into it)."""
    settings = settings or Settings()
    service = Service(settings, launcher)
    if settings.otlp_traces_endpoint:  # OpenTelemetry is imported only then
        service.tracing = Tracing.exporting_to(settings.otlp_traces_endpoint)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(service.load())
        gc.freeze()  # the app's 70k start-up objects: out of every full collection (24 ms)
        try:
            yield
        finally:
            loading.cancel()
            await service.close()

    app = FastAPI(title="ordinal", version="0.1.0", lifespan=lifespan)
    app.state.service = service
    install_error_handlers(app)
    document_errors(app)
    app.include_router(router)
    app.include_router(playground_router)  # GET /, POST /v1/trace
    app.mount("/static", static_files(), name="static")
    # add_middleware wraps: the last added runs first.
    app.add_middleware(LimitBody, max_bytes=settings.max_body_bytes)
    if settings.api_key is not None:
        keys = [settings.api_key.get_secret_value(), *(k for k, _ in service.priorities.keys)]
        app.add_middleware(RequireApiKey, keys=keys, scope=settings.auth_scope)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    # A trace is up to megabytes of JSON that gzip shrinks several-fold; level 1 because the
    # compression runs on the event loop (level 9 takes 25x as long for a 15% smaller body,
    # bench/trace.py). Streams are never buffered by it: Starlette's GZipMiddleware passes
    # text/event-stream through as it is sent.
    app.add_middleware(GZipMiddleware, minimum_size=1024, compresslevel=1)
    app.add_middleware(CatchUnexpected)  # inside CountRequests, so its 500s are counted
    app.add_middleware(AllowHosts, allowed=settings.allowed_hosts)  # before anything is read
    app.add_middleware(CountRequests, counter=service.metrics.requests)
    if service.tracing is not None:  # outermost: a span covers whatever answers the request
        app.add_middleware(TraceRequests, tracing=service.tracing)
    return app


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Flags given on the command line, over the environment, over the defaults.

    A bad value raises ValueError with one line per bad setting, ``name: what is wrong``.
    """
    given = {name: value for name, value in vars(args).items() if name in Settings.model_fields}
    try:
        return Settings(**given)
    except ValidationError as error:
        lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()]
        raise ValueError("; ".join(line.replace("Value error, ", "") for line in lines)) from None


def run(args: argparse.Namespace) -> None:
    """``ordinal serve``: check the settings, then serve until interrupted."""
    settings = settings_from_args(args)
    check_settings(settings)
    # uvicorn configures its own loggers only: ours (a line per model loaded or failed) too.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, **serving(settings))


def serving(settings: Settings) -> dict[str, Any]:
    """uvicorn's options for ``settings``: keep-alive and header timeouts, connection limit."""
    return {
        "http": guarded_protocol(settings.max_connections, settings.header_timeout),
        "timeout_keep_alive": settings.keep_alive_timeout,
    }
