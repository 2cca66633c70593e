"""Prometheus metrics, in a registry of their own per app (two apps in one process never mix).

The per-model set follows vLLM's names, labels and meanings under the ``ordinal_`` prefix
(``vllm:num_requests_running{model_name=...}`` → ``ordinal_num_requests_running{model_name=...}``,
and so on, ``kv_cache_usage_perc`` and ``request_max_num_generation_tokens`` included), so a
dashboard built for vLLM needs only the prefix changed (``tests/server/test_vllm_dashboard.py``
runs its queries' names and labels). HTTP answers are counted by route template and
status, so health probes and scrapes never mix with completions; the process collector adds
CPU, memory and open files.

A request's phases, each a histogram: queue (arrival → a batch row), prefill (row → first token),
decode (first → last token) and end to end (arrival → last token). Inter-token latency is
observed once per decode step: the time between two consecutive steps is what every sequence
in the batch saw between two tokens.

The engine process measures (``server.messages.ModelStats``, sent with its events) and the API
process records: :meth:`ModelMetrics.record`, with each model's label children bound once.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from model.sampling_params import FailureReason
from server.messages import MODEL_ERROR, SHUTDOWN, ModelStats

# Why a request failed after it reached an engine (the ``reason`` label of request failures).
TIMEOUT = "timeout"  # the request outlived the request timeout
ENGINE_LOST = "engine_lost"  # the engine process died while the request was in it
FAILURE_REASONS = (
    *(reason.value for reason in FailureReason),
    MODEL_ERROR,
    TIMEOUT,
    SHUTDOWN,
    ENGINE_LOST,
)
# How a request that did not fail ended (vLLM's ``finished_reason``): "abort" = the client left.
FINISHED_REASONS = ("stop", "length", "abort")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class ModelMetrics:
    """One model's metrics, labels already applied."""

    running: Gauge  # sequences decoding now
    waiting: Gauge  # requests waiting for a batch row
    prompt_tokens: Counter
    generation_tokens: Counter
    finished: dict[str, Counter]  # finished_reason → counter, every one of FINISHED_REASONS
    failures: dict[str, Counter]  # reason → counter, every one of FAILURE_REASONS
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_latency: Histogram
    queue_time: Histogram
    prefill_time: Histogram
    decode_time: Histogram
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    request_max_num_generation_tokens: Histogram  # the max_tokens of each request submitted
    kv_cache_usage: Gauge
    prefix_cache_queries: Counter  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: Counter  # of those, the tokens it held
    spec_decode_num_drafts: Counter  # speculative proposals verified
    spec_decode_num_draft_tokens: Counter  # the tokens they proposed
    spec_decode_num_accepted_tokens: Counter  # of those, the tokens kept

    def record(self, stats: ModelStats) -> None:
        """Apply what the engine process measured since its previous frame."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.prompt_tokens.inc(sum(stats.prompt_tokens))
        for count in stats.prompt_tokens:
            self.request_prompt_tokens.observe(count)
        if stats.generation_tokens:
            self.generation_tokens.inc(stats.generation_tokens)
        for seconds in stats.queue_times:
            self.queue_time.observe(seconds)
        for ttft, prefill in stats.first_tokens:
            self.time_to_first_token.observe(ttft)
            self.prefill_time.observe(prefill)
        for seconds in stats.inter_token:
            self.inter_token_latency.observe(seconds)
        for finish in stats.finished:
            self.finished[finish.reason].inc()
            if finish.reason != "abort":
                self.e2e_latency.observe(finish.e2e)
                self.decode_time.observe(finish.decode)
                self.request_generation_tokens.observe(finish.generated)
        for reason, count in stats.failures.items():
            self.failures[reason].inc(count)
        if stats.prefix_queries:
            self.prefix_cache_queries.inc(stats.prefix_queries)
            self.prefix_cache_hits.inc(stats.prefix_hits)
        if stats.spec_drafts:
            self.spec_decode_num_drafts.inc(stats.spec_drafts)
            self.spec_decode_num_draft_tokens.inc(stats.spec_draft_tokens)
            self.spec_decode_num_accepted_tokens.inc(stats.spec_accepted_tokens)


class Metrics:
    """The service's metrics and the registry they are exported from."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self._bound: dict[str, ModelMetrics] = {}
        ProcessCollector(registry=registry)  # process_cpu_seconds_total, memory, open fds
        model = ["model_name"]  # vLLM's label: its dashboards filter on it

        def latency(name: str, doc: str, buckets: tuple[float, ...] = REQUEST_BUCKETS) -> Histogram:
            return Histogram(f"ordinal_{name}", doc, model, buckets=buckets, registry=registry)

        def tokens(name: str, doc: str) -> Histogram:
            return Histogram(
                f"ordinal_{name}", doc, model, buckets=TOKEN_BUCKETS, registry=registry
            )

        self.requests = Counter(
            "ordinal_requests",
            "HTTP requests answered, by route template (unmatched for none) and status code",
            ["route", "status"],
            registry=registry,
        )
        self.running = Gauge(
            "ordinal_num_requests_running", "Sequences decoding now", model, registry=registry
        )
        self.waiting = Gauge(
            "ordinal_num_requests_waiting", "Requests waiting for a row", model, registry=registry
        )
        self.prompt_tokens = Counter(
            "ordinal_prompt_tokens", "Prompt tokens prefilled", model, registry=registry
        )
        self.generation_tokens = Counter(
            "ordinal_generation_tokens", "Tokens generated", model, registry=registry
        )
        self.finished = Counter(
            "ordinal_request_success",
            "Requests that ended without failing, by finished_reason (stop, length, abort)",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.failures = Counter(
            "ordinal_request_failures",
            "Requests that failed after reaching an engine, by reason",
            ["model_name", "reason"],
            registry=registry,
        )
        self.time_to_first_token = latency(
            "time_to_first_token_seconds", "Arrival to first token", LATENCY_BUCKETS
        )
        self.inter_token_latency = latency(
            "inter_token_latency_seconds", "Between decode steps (one per step)", LATENCY_BUCKETS
        )
        self.e2e_latency = latency("e2e_request_latency_seconds", "Arrival to last token")
        self.queue_time = latency("request_queue_time_seconds", "Arrival to a batch row")
        self.prefill_time = latency("request_prefill_time_seconds", "Batch row to first token")
        self.decode_time = latency("request_decode_time_seconds", "First to last token")
        self.request_prompt_tokens = tokens("request_prompt_tokens", "Prompt tokens per request")
        self.request_generation_tokens = tokens(
            "request_generation_tokens", "Generated tokens per finished request"
        )
        self.request_max_num_generation_tokens = tokens(
            "request_max_num_generation_tokens", "The most tokens a request may generate"
        )
        self.kv_cache_usage = Gauge(
            "ordinal_kv_cache_usage_perc",
            "Fraction of the KV cache's most (rows × context) holding keys (1 = full)",
            model,
            registry=registry,
        )

        # vLLM's prefix-cache counters, in tokens (hits / queries is the hit rate)
        self.prefix_cache_queries = Counter(
            "ordinal_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            model,
            registry=registry,
        )
        self.prefix_cache_hits = Counter(
            "ordinal_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (not prefilled again)",
            model,
            registry=registry,
        )
        self._speculation_counters(model)

    def _speculation_counters(self, model: list[str]) -> None:
        """vLLM's speculative decoding counters (acceptance = accepted / draft tokens)."""

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"ordinal_spec_decode_num_{name}", doc, model, registry=self.registry)

        self.spec_decode_num_drafts = counter("drafts", "Speculative proposals verified")
        self.spec_decode_num_draft_tokens = counter("draft_tokens", "Tokens speculation proposed")
        self.spec_decode_num_accepted_tokens = counter(
            "accepted_tokens", "Proposed tokens that verification kept"
        )

    def for_model(self, name: str) -> ModelMetrics:
        """``name``'s label children, bound once (``record`` runs for every engine frame)."""
        bound = self._bound.get(name)
        if bound is None:
            bound = self._bound[name] = self._bind(name)
        return bound

    def _bind(self, name: str) -> ModelMetrics:
        return ModelMetrics(
            running=self.running.labels(name),
            waiting=self.waiting.labels(name),
            prompt_tokens=self.prompt_tokens.labels(name),
            generation_tokens=self.generation_tokens.labels(name),
            finished={reason: self.finished.labels(name, reason) for reason in FINISHED_REASONS},
            failures={reason: self.failures.labels(name, reason) for reason in FAILURE_REASONS},
            time_to_first_token=self.time_to_first_token.labels(name),
            inter_token_latency=self.inter_token_latency.labels(name),
            e2e_latency=self.e2e_latency.labels(name),
            queue_time=self.queue_time.labels(name),
            prefill_time=self.prefill_time.labels(name),
            decode_time=self.decode_time.labels(name),
            request_prompt_tokens=self.request_prompt_tokens.labels(name),
            request_generation_tokens=self.request_generation_tokens.labels(name),
            request_max_num_generation_tokens=self.request_max_num_generation_tokens.labels(name),
            kv_cache_usage=self.kv_cache_usage.labels(name),
            prefix_cache_queries=self.prefix_cache_queries.labels(name),
            prefix_cache_hits=self.prefix_cache_hits.labels(name),
            spec_decode_num_drafts=self.spec_decode_num_drafts.labels(name),
            spec_decode_num_draft_tokens=self.spec_decode_num_draft_tokens.labels(name),
            spec_decode_num_accepted_tokens=self.spec_decode_num_accepted_tokens.labels(name),
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
