"""Schema fuzzing: schemathesis generates requests from the server's own ``/openapi.json`` —
valid ones and ones that break the schema — and sends them to a real server. No answer may be
a 5xx, and every answer (status, content type, body) must be what the schema documents.

About 1,100 requests in all, on one tiny model whose context is kept short so that a valid
request decodes few tokens: ~30 s on two cores.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from server.api.app import create_app
from server.api.settings import Settings
from tests.server.conftest import Running, running_server, test_settings

EXAMPLES_PER_OPERATION = 75  # 3,3xx requests in all (4,808 at 110): three times MIN_REQUESTS
MIN_REQUESTS = 1000
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
sent: Counter[str] = Counter()  # requests per operation, and their statuses


@pytest.fixture(scope="module")
def fuzzed_server(checkpoints: Path) -> Iterator[Running]:
    settings_ = test_settings(
        checkpoints, models=["rope"], max_context=24, max_queue=64, stream_interval=0
    )
    with running_server(settings_) as running:
        yield running


def documented_schema() -> dict[str, Any]:
    """The app's ``/openapi.json``, as it serves it (building it loads no model)."""
    return create_app(Settings(checkpoints=Path("unused"))).openapi()


schema = schemathesis.openapi.from_dict(documented_schema())


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,  # the same requests every run: a failure can be reproduced
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_no_request_gets_a_5xx_or_an_undocumented_answer(fuzzed_server: Running, case: Any) -> None:
    response = case.call(base_url=fuzzed_server.url, timeout=30)
    sent[f"{case.method} {case.path}"] += 1
    sent[f"status {response.status_code}"] += 1
    case.validate_response(response, checks=CHECKS)


def test_the_fuzzed_schema_is_the_one_the_server_serves(fuzzed_server: Running) -> None:
    served = httpx.get(f"{fuzzed_server.url}/openapi.json", timeout=30).json()
    assert served == documented_schema()
    assert not [
        (path, method)
        for path, operations in served["paths"].items()
        for method, operation in operations.items()
        if "422" in operation["responses"]
    ]


def test_the_fuzzer_sent_enough_requests() -> None:
    """Runs after the fuzzing test above (pytest keeps file order)."""
    operations = {key: n for key, n in sent.items() if not key.startswith("status")}
    statuses = {key: n for key, n in sent.items() if key.startswith("status")}
    print(f"fuzzing: {sum(operations.values())} requests; {operations}; {statuses}")
    assert sum(operations.values()) >= MIN_REQUESTS, sent
    assert not [key for key in statuses if key.startswith("status 5")], statuses
    assert statuses.get("status 200", 0) > 100 and statuses.get("status 400", 0) > 100, statuses
