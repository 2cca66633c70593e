"""OpenTelemetry traces, optional (``--otlp-traces-endpoint``; the ``otel`` extra): one span per
POST request, continuing the caller's W3C ``traceparent``, under the ``gen_ai.*`` attribute names
vLLM's tracing uses (``vllm/tracing.py``'s ``SpanAttributes``), exported over OTLP/HTTP.

Off (the default) this module's classes are never built and ``opentelemetry`` is never imported:
the app has no :class:`TraceRequests` middleware, and a route finds no :class:`SpanRecord` on its
request (``request.state.span``), so the only cost is that lookup.

On, :class:`TraceRequests` stamps each POST's arrival, hands the route a :class:`SpanRecord` to
fill (a generation's usage and latencies, ``completions.respond``; an embedding's usage) and,
once the response has been sent whole (a stream's last event included), exports the span with
its start at the arrival: ``llm_request``, kind SERVER, as vLLM names it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.job import Job
from server.api.writer import CompletionWriter, total_usage

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

SPAN_NAME = "llm_request"
# vLLM's names (vllm/tracing.py, SpanAttributes), and the semantic conventions' request model.
MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
REQUEST_ID = "gen_ai.request.id"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
N = "gen_ai.request.n"
PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
E2E = "gen_ai.latency.e2e"
MISSING = (
    "--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP exporter, which are not "
    "installed: pip install 'ordinal[otel]'"
)


@dataclass
class SpanRecord:
    """One request's span as the routes fill it: its arrival, and its attributes."""

    start_ns: int  # wall clock (the span's start)
    start: float  # time.monotonic(), the clock the engine's times are on
    attributes: dict[str, Any] = field(default_factory=dict)

    def model(self, name: str) -> None:
        self.attributes[MODEL] = self.attributes[RESPONSE_MODEL] = name

    def generation(
        self, model: str, jobs: Sequence[Job | None], writers: Sequence[CompletionWriter]
    ) -> None:
        """A generating request's attributes, once its jobs have ended: the usage its answer
        counted, the first token's latency from the arrival, the longest wait in the engine's
        queue (one job per choice)."""
        self.model(model)
        usage = total_usage(writers)
        given = [job for job in jobs if job is not None]
        self.attributes |= {
            REQUEST_ID: writers[0].id,
            N: len(writers),
            PROMPT_TOKENS: usage["prompt_tokens"],
            COMPLETION_TOKENS: usage["completion_tokens"],
        }
        if given:
            params = given[0].params
            self.attributes |= {
                MAX_TOKENS: given[0].max_tokens,
                TEMPERATURE: params.temperature,
                TOP_P: params.top_p,
            }
        firsts = [w.first_token_at for w in writers if w.first_token_at is not None]
        if firsts:
            self.attributes[TIME_TO_FIRST_TOKEN] = min(firsts) - self.start
            self.attributes[TIME_IN_QUEUE] = max(w.queue_time for w in writers)

    def usage(self, prompt_tokens: int) -> None:
        """A request that generates nothing (embeddings): the tokens it computed."""
        self.attributes[PROMPT_TOKENS] = prompt_tokens


class Tracing:
    """Exports each request's span through ``provider`` (its processors and exporters)."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("ordinal.server")
        self.propagator = TraceContextTextMapPropagator()
        self.kind, self.error = SpanKind.SERVER, Status(StatusCode.ERROR)

    @classmethod
    def exporting_to(cls, endpoint: str) -> Tracing:
        """Spans batched to the OTLP/HTTP collector at ``endpoint`` (its full URL, e.g.
        http://localhost:4318/v1/traces); a ValueError saying what to install without the
        ``otel`` extra."""
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            raise ValueError(MISSING) from None
        provider = TracerProvider(resource=Resource.create({"service.name": "ordinal"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        return cls(provider)

    def export(self, scope: Scope, record: SpanRecord, status: int) -> None:
        """The request's span, ended now, in the trace its ``traceparent`` names (a new one
        without)."""
        headers = Headers(scope=scope)
        carrier = {name: headers[name] for name in ("traceparent", "tracestate") if name in headers}
        attributes = {
            "http.request.method": scope["method"],
            "url.path": scope["path"],
            "http.response.status_code": status,
            **record.attributes,
        }
        span = self.tracer.start_span(
            SPAN_NAME,
            context=self.propagator.extract(carrier),
            kind=self.kind,
            attributes=attributes,
            start_time=record.start_ns,
        )
        if status >= 500:
            span.set_status(self.error)
        span.end()

    def shutdown(self) -> None:
        """Send what is batched, then stop (the server is stopping)."""
        self.provider.shutdown()


class TraceRequests:
    """Pure ASGI middleware, installed only with tracing on: a span for each POST request,
    exported once its response has been sent whole."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app, self.tracing = app, tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        record = SpanRecord(time.time_ns(), time.monotonic())
        scope.setdefault("state", {})["span"] = record
        status = 500  # unless a response starts

        async def watching_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        finally:
            record.attributes[E2E] = time.monotonic() - record.start
            self.tracing.export(scope, record, status)
