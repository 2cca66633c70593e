"""vLLM's Grafana dashboards, pointed at ordinal after the prefix rename (``vllm:`` →
``ordinal_``): every metric their queries read exists, labelled ``model_name`` as vLLM's, and has
data once the model has served a request. The names are those vLLM's dashboards query (its
``examples/observability`` folder): histograms by their ``_bucket`` series, counters by ``_total``.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import Running, wait_for

MODEL = "sinusoidal"
# The series vLLM's dashboard queries read, as it names them.
DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_max_num_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_decode_time_seconds_bucket",
]


def renamed(series: str) -> str:
    return series.replace("vllm:", "ordinal_", 1)


def samples(client: httpx.Client) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def max_tokens_buckets(exposed: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, float]:
    """request_max_num_generation_tokens's cumulative buckets for MODEL (0 before any request)."""
    return {
        labels["le"]: value
        for labels, value in exposed.get(
            renamed("vllm:request_max_num_generation_tokens_bucket"), []
        )
        if labels["model_name"] == MODEL
    }


def test_vllm_dashboard_queries_find_data(server: Running, client: httpx.Client) -> None:
    max_tokens = 7
    before = max_tokens_buckets(samples(client))  # the server is shared with other tests
    body = {"model": MODEL, "prompt": "To be", "max_tokens": max_tokens, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    wait_for(lambda: server.engine(MODEL).in_flight == 0, "the request to finish")
    exposed = samples(client)
    for series in DASHBOARD_SERIES:
        ours = [
            value
            for labels, value in exposed.get(renamed(series), [])
            if labels.get("model_name") == MODEL  # the dashboard's {model_name="$model_name"}
        ]
        assert ours, f"{series} → {renamed(series)} has no series with model_name={MODEL!r}"
        if series.endswith(("_count", "_total")) and "success" not in series:
            assert sum(ours) > 0, series
    assert all("model" not in labels for name in exposed for labels, _ in exposed[name])

    # request_max_num_generation_tokens observed the request's max_tokens
    buckets = max_tokens_buckets(exposed)
    added = {le: count - before.get(le, 0) for le, count in buckets.items()}
    assert added["4.0"] == 0 and added["8.0"] == 1
    usage = [v for labels, v in exposed["ordinal_kv_cache_usage_perc"] if labels["model_name"]]
    assert usage and all(0 <= value <= 1 for value in usage)
