"""vLLM's Grafana dashboards, pointed at ordinal after the prefix rename (``vllm:`` →
``ordinal_``): every metric their queries read exists, labelled ``model_name`` as vLLM's, and has
data once the model has served a request. The names are those vLLM's dashboards query (its
``examples/observability`` folder): histograms by their ``_bucket`` series, counters by ``_total``.
Then ordinal's own dashboard (``deploy/grafana/dashboards/ordinal.json``, the compose
``monitoring`` profile's): every metric each panel's queries name is one ``/metrics`` exports.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
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


# ---- ordinal's own dashboard ------------------------------------------------------------------

DASHBOARD = (
    Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "ordinal.json"
)
# PromQL's words that are not metrics: the keywords, and the labels of by(...) / without(...)
# (removed before names are read); a function is a name followed by "(".
KEYWORDS = {"and", "or", "unless", "bool", "offset", "on", "ignoring", "group_left", "group_right"}


def metric_names(expr: str) -> set[str]:
    """The metrics a PromQL expression reads: every name left once strings, label matchers
    ``{...}``, ranges ``[...]``, grouping ``by (...)`` and function names are taken out."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"|\{[^}]*\}|\[[^\]]*\]', " ", expr)
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    names = re.findall(r"(?<![\w:.])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()", bare)
    return set(names) - KEYWORDS


def test_metric_names_reads_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by(le, model_name) (rate(ordinal_x_bucket{model_name=~"$m"}'
        "[$__rate_interval]))) / sum without (le) (ordinal_y_total offset 5m) and on(job) up"
    )
    assert metric_names(expr) == {"ordinal_x_bucket", "ordinal_y_total", "up"}


def dashboard_queries() -> dict[str, list[str]]:
    """Each panel's title → its queries' expressions; the model variable's query too."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = {
        panel["title"]: [t["expr"] for t in panel["targets"]] for panel in dashboard["panels"]
    }
    for variable in dashboard["templating"]["list"]:
        call = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["query"]["query"])
        assert call, variable["query"]
        queries[f"variable ${variable['name']}"] = [call[1]]
    return queries


def test_every_panel_of_ordinals_dashboard_queries_metrics_that_exist(
    server: Running, client: httpx.Client
) -> None:
    body = {"model": MODEL, "prompt": "To be", "max_tokens": 2, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).status_code == 200  # every series bound
    wait_for(lambda: server.engine(MODEL).in_flight == 0, "the request to finish")
    exposed = samples(client)
    read: set[str] = set()
    for title, expressions in dashboard_queries().items():
        assert expressions, f"{title}: no query"
        for expr in expressions:
            names = metric_names(expr)
            assert names, f"{title}: {expr!r} reads no metric"
            missing = names - set(exposed)
            assert not missing, f"{title}: {sorted(missing)} not in /metrics"
            read |= names
    # and every metric family of ordinal's own is on some panel
    exported = {family(name) for name in exposed if name.startswith("ordinal_")}
    unread = exported - {family(name) for name in read}
    assert not unread, f"metrics on no panel: {sorted(unread)}"


def family(name: str) -> str:
    """The metric a series belongs to: ``x_bucket``, ``x_sum``, ``x_total`` … → ``x``."""
    return re.sub(r"_(bucket|sum|count|total|created)$", "", name)


@pytest.mark.parametrize("wrong", ["ordinal_num_requests_runing", "vllm:num_requests_running"])
def test_a_misspelt_metric_fails_the_dashboard_check(wrong: str, client: httpx.Client) -> None:
    """The check above can fail: a panel naming a metric that is not exported."""
    expr = f'sum by(model_name) ({wrong}{{model_name=~"$model_name"}})'
    assert not metric_names(expr) <= set(samples(client))
