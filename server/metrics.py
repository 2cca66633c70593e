"""Prometheus metrics, in a registry of their own per app (two apps in one process never mix).

Engines get their label children bound once (:class:`ModelMetrics`), so a decode step touches
no label lookup. Inter-token latency is observed once per decode step: the time between two
consecutive steps is the latency every sequence in the batch saw between two tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from model.sampling import FailureReason

# Why a request failed after it reached an engine (the ``reason`` label of request failures).
MODEL_ERROR = "model_error"  # the batch's forward pass raised: every row in it failed
TIMEOUT = "timeout"  # the request outlived the request timeout
SHUTDOWN = "shutdown"  # the server stopped while the request was running or queued
FAILURE_REASONS = (*(reason.value for reason in FailureReason), MODEL_ERROR, TIMEOUT, SHUTDOWN)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class ModelMetrics:
    """One model's metrics, labels already applied."""

    time_to_first_token: Histogram
    inter_token_latency: Histogram
    generated_tokens: Counter
    queue_depth: Gauge
    running_batch_size: Gauge
    failures: dict[str, Counter]  # reason → counter, every reason of FAILURE_REASONS


class Metrics:
    """The service's metrics and the registry they are exported from."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "ordinal_requests", "HTTP requests answered, by status code", ["status"],
            registry=registry,
        )  # fmt: skip
        self.time_to_first_token = Histogram(
            "ordinal_time_to_first_token_seconds",
            "From a request's arrival to its first generated token",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "ordinal_inter_token_latency_seconds",
            "Time between consecutive decode steps (one observation per step)",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.generated_tokens = Counter(
            "ordinal_generated_tokens", "Tokens generated", ["model"], registry=registry
        )
        self.queue_depth = Gauge(
            "ordinal_queue_depth", "Requests waiting for a batch row", ["model"], registry=registry
        )
        self.running_batch_size = Gauge(
            "ordinal_running_batch_size", "Sequences decoding now", ["model"], registry=registry
        )
        self.request_failures = Counter(
            "ordinal_request_failures",
            "Requests that failed after reaching an engine, by reason",
            ["model", "reason"],
            registry=registry,
        )

    def for_model(self, name: str) -> ModelMetrics:
        return ModelMetrics(
            self.time_to_first_token.labels(name),
            self.inter_token_latency.labels(name),
            self.generated_tokens.labels(name),
            self.queue_depth.labels(name),
            self.running_batch_size.labels(name),
            {reason: self.request_failures.labels(name, reason) for reason in FAILURE_REASONS},
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
