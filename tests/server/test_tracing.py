"""OpenTelemetry, optional: with ``--otlp-traces-endpoint`` a real server exports one span per
POST request, seen here by the SDK's in-memory exporter (added to the server's own provider) and
by a fake OTLP/HTTP collector (what the flag's exporter sends); each span carries vLLM's
``gen_ai.*`` attributes with the answer's own counts, continues the caller's ``traceparent``,
and times the engine's queue. Off, nothing of OpenTelemetry is imported."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from server.api.app import create_app
from server.api.settings import Settings
from server.api.tracing import MISSING, TraceRequests, Tracing
from tests.server.conftest import Running, openai_client, running_server, test_settings, wait_for
from tests.server.test_process_imports import imported_after

MESSAGES = [{"role": "user", "content": "Good morrow."}]


class Collector:
    """A fake OTLP/HTTP collector on a free loopback port: the spans each export carried."""

    def __init__(self) -> None:
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name for it
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                received.extend(
                    span
                    for resource in request.resource_spans
                    for scope in resource.scope_spans
                    for span in scope.spans
                )
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    running = Collector()
    yield running
    running.server.shutdown()


@pytest.fixture(scope="module")
def traced(
    checkpoints: Path, collector: Collector
) -> Iterator[tuple[Running, InMemorySpanExporter]]:
    """A server with tracing on (one row, so that a second request waits in the queue), and an
    in-memory exporter beside the flag's own."""
    settings = test_settings(
        checkpoints,
        models=["rope"],
        max_batch_size=1,
        stream_interval=0,
        otlp_traces_endpoint=collector.url,
    )
    with running_server(settings) as running:
        tracing = running.service.tracing
        assert tracing is not None
        exporter = InMemorySpanExporter()
        tracing.provider.add_span_processor(SimpleSpanProcessor(exporter))
        yield running, exporter


def traceparent(index: int) -> tuple[str, int, int]:
    """A W3C traceparent header of a caller's span: (header, trace id, span id)."""
    trace_id, span_id = 0xABC0 + index << 64 | 0x1234, 0xFEED0 + index
    return f"00-{trace_id:032x}-{span_id:016x}-01", trace_id, span_id


def spans_of(exporter: InMemorySpanExporter, count: int) -> list[ReadableSpan]:
    """The first ``count`` spans exported (a span is exported just after its answer is sent)."""
    wait_for(lambda: len(exporter.get_finished_spans()) >= count, f"{count} spans", 10)
    time.sleep(0.05)  # one too many would show
    return list(exporter.get_finished_spans())


def test_one_span_per_request_with_vllms_attributes_in_the_callers_trace(
    traced: tuple[Running, InMemorySpanExporter],
) -> None:
    server, exporter = traced
    exporter.clear()
    headers = [traceparent(index) for index in range(5)]
    chat = openai_client(server).chat.completions.create(
        model="rope",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0.5,
        extra_body={"ignore_eos": True},
        extra_headers={"traceparent": headers[0][0]},
    )
    streamed = list(
        openai_client(server).completions.create(
            model="rope",
            prompt="To be",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            extra_headers={"traceparent": headers[1][0]},
        )
    )
    message = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0).messages.create(
        model="rope",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=4,
        extra_body={"ignore_eos": True},
        extra_headers={"traceparent": headers[2][0]},
    )
    embedded = openai_client(server).embeddings.create(
        model="rope", input=["a", "To be"], extra_headers={"traceparent": headers[3][0]}
    )
    refused = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "rope", "prompt": "a", "temperature": 9},
        headers={"traceparent": headers[4][0]},
    )
    assert refused.status_code == 400
    httpx.get(f"{server.url}/health")  # not a POST: no span
    untraced = httpx.post(f"{server.url}/v1/tokenize", json={"prompt": "a"})  # a new trace

    spans = spans_of(exporter, 6)
    assert len(spans) == 6  # one per POST request, none for the GET
    by_trace = {span.context.trace_id: span for span in spans}
    assert set(by_trace) >= {trace_id for _, trace_id, _ in headers}
    for _, trace_id, span_id in headers:  # each continues its caller's span
        span = by_trace[trace_id]
        assert span.parent is not None and span.parent.span_id == span_id
        assert span.name == "llm_request" and span.kind == SpanKind.SERVER
    (fresh,) = [s for s in spans if s.context.trace_id not in {t for _, t, _ in headers}]
    assert fresh.parent is None and untraced.status_code == 200

    usage = chat.usage
    assert usage is not None
    first = by_trace[headers[0][1]].attributes
    assert first["gen_ai.request.model"] == first["gen_ai.response.model"] == "rope"
    assert first["gen_ai.request.id"] == chat.id
    assert first["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    assert first["gen_ai.usage.completion_tokens"] == usage.completion_tokens == 6
    assert first["gen_ai.request.max_tokens"] == 6 and first["gen_ai.request.temperature"] == 0.5
    assert first["http.response.status_code"] == 200
    ttft, e2e = first["gen_ai.latency.time_to_first_token"], first["gen_ai.latency.e2e"]
    assert 0 <= first["gen_ai.latency.time_in_queue"] <= ttft
    assert 0 < ttft <= e2e
    span = by_trace[headers[0][1]]
    assert span.end_time is not None and span.start_time is not None
    assert abs((span.end_time - span.start_time) / 1e9 - e2e) < 0.05

    stream_usage = streamed[-1].usage
    assert stream_usage is not None
    second = by_trace[headers[1][1]].attributes
    assert second["gen_ai.usage.completion_tokens"] == stream_usage.completion_tokens == 5
    assert second["gen_ai.usage.prompt_tokens"] == stream_usage.prompt_tokens
    third = by_trace[headers[2][1]].attributes
    cached = message.usage.cache_read_input_tokens or 0
    assert third["gen_ai.usage.prompt_tokens"] == message.usage.input_tokens + cached
    assert third["gen_ai.usage.completion_tokens"] == message.usage.output_tokens == 4
    fourth = by_trace[headers[3][1]].attributes
    assert fourth["gen_ai.usage.prompt_tokens"] == embedded.usage.prompt_tokens
    assert fourth["gen_ai.request.model"] == "rope"
    fifth = by_trace[headers[4][1]].attributes
    assert fifth["http.response.status_code"] == 400 and "gen_ai.usage.prompt_tokens" not in fifth


def test_time_in_queue_is_the_wait_for_a_row(traced: tuple[Running, InMemorySpanExporter]) -> None:
    """One row: B waits while A holds it (A's forward held by a gate for HELD seconds)."""
    server, exporter = traced
    exporter.clear()
    held = 0.4
    (a_header, a_trace, _), (b_header, b_trace, _) = traceparent(10), traceparent(11)
    gate = server.gate("rope")

    def send(header: str) -> None:
        openai_client(server).completions.create(
            model="rope",
            prompt="To be",
            max_tokens=4,
            extra_body={"ignore_eos": True},
            extra_headers={"traceparent": header},
        )

    first = threading.Thread(target=send, args=(a_header,))
    second = threading.Thread(target=send, args=(b_header,))
    try:
        first.start()
        wait_for(lambda: server.engine("rope").in_flight == 1, "A in the engine")
        time.sleep(0.2)  # A is admitted and held in its forward
        second.start()
        wait_for(lambda: server.engine("rope").in_flight == 2, "B in the engine")
        time.sleep(held)
    finally:
        gate.open()
        first.join(30)
        second.join(30)
    spans = {span.context.trace_id: span.attributes for span in spans_of(exporter, 2)}
    a, b = spans[a_trace], spans[b_trace]
    assert a["gen_ai.latency.time_in_queue"] < 0.1
    assert b["gen_ai.latency.time_in_queue"] >= held
    assert b["gen_ai.latency.time_to_first_token"] >= b["gen_ai.latency.time_in_queue"]
    assert a["gen_ai.latency.time_to_first_token"] >= held  # A's first token waited on the gate


def test_the_flags_exporter_sends_the_spans_to_the_collector(
    traced: tuple[Running, InMemorySpanExporter], collector: Collector
) -> None:
    server, _ = traced
    header, trace_id, span_id = traceparent(20)
    httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "rope", "prompt": "a", "max_tokens": 2},
        headers={"traceparent": header},
    )
    tracing = server.service.tracing
    assert tracing is not None

    def arrived() -> list[Any]:
        tracing.provider.force_flush()
        return [s for s in collector.received if int.from_bytes(s.trace_id) == trace_id]

    wait_for(lambda: bool(arrived()), "the span at the collector", 10)
    (span,) = arrived()
    assert span.name == "llm_request" and int.from_bytes(span.parent_span_id) == span_id
    attributes = {kv.key: kv.value for kv in span.attributes}
    assert attributes["gen_ai.usage.completion_tokens"].int_value <= 2
    assert attributes["gen_ai.request.model"].string_value == "rope"


def test_off_by_default_nothing_of_opentelemetry_is_imported() -> None:
    """Ordinal imports none of it. (FastAPI itself, from 0.16x, imports OpenTelemetry's API
    when it is installed, for telemetry of its own that stays off without a global provider;
    ordinal sets none, and adds nothing to what FastAPI imported.)"""
    code = (
        "import sys\nfrom pathlib import Path\nimport fastapi\n"
        "before = {m for m in sys.modules if m.startswith('opentelemetry')}\n"
        "import server.api.app\nfrom server.api.settings import Settings\n"
        "app = server.api.app.create_app(Settings(checkpoints=Path('unused')))\n"
        "assert app.state.service.tracing is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry') and m not in before))"
    )
    sdk = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto")
    found, added = imported_after(code, sdk)
    assert found == [] and added.strip() == "[]", (found, added)
    app = create_app(Settings(checkpoints=Path("unused")))
    assert TraceRequests not in [middleware.cls for middleware in app.user_middleware]
    traced_app = create_app(
        Settings(checkpoints=Path("unused"), otlp_traces_endpoint="http://127.0.0.1:9/v1/traces")
    )
    assert TraceRequests in [middleware.cls for middleware in traced_app.user_middleware]
    assert traced_app.state.service.tracing is not None
    traced_app.state.service.tracing.shutdown()


def test_without_the_extra_the_flag_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with pytest.raises(ValueError, match=r"pip install 'ordinal\[otel\]'") as raised:
        Tracing.exporting_to("http://127.0.0.1:9/v1/traces")
    assert str(raised.value) == MISSING
