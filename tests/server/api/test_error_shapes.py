"""server/api/errors.py on its own: every error body's shape, type and code, the validation
messages, the OpenAPI error responses, and the handlers, through a small FastAPI app and
through ordinal's app without its models (its lifespan never runs, so nothing loads).

These are fast (no model, no server process): the mutation run judges server/api/errors.py with
this file alone (pyproject.toml, [tool.ordinal.mutation]).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from server.api.app import create_app
from server.api.errors import (
    ERROR_DESCRIPTIONS,
    ERROR_TYPES,
    APIError,
    ErrorBody,
    busy,
    document_errors,
    error_event,
    error_responses,
    install_error_handlers,
    validation_error,
)
from server.api.settings import Settings

# OpenAI's error types, written out here rather than read from ERROR_TYPES.
EXPECTED_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}


# ---- APIError, busy, error_event ------------------------------------------------------------


@pytest.mark.parametrize("status", sorted(EXPECTED_TYPES))
def test_every_status_has_its_openai_type(status: int) -> None:
    error = APIError(status, "what went wrong", param="top_p", code="some_code")
    assert error.body() == {
        "error": {
            "message": "what went wrong",
            "type": EXPECTED_TYPES[status],
            "param": "top_p",
            "code": "some_code",
        }
    }
    assert ERROR_TYPES.get(status, "server_error") == EXPECTED_TYPES[status]


def test_an_error_without_param_or_code_says_null() -> None:
    error = APIError(404, "no such model")
    assert error.body() == {
        "error": {
            "message": "no such model",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    assert str(error) == "no such model" and error.headers is None
    assert (error.status, error.message, error.param, error.code) == (
        404,
        "no such model",
        None,
        None,
    )


def test_the_response_is_the_json_body_with_status_and_headers() -> None:
    error = APIError(429, "slow down", code="queue_full", headers={"Retry-After": "7"})
    response = error.response()
    assert response.status_code == 429
    assert response.media_type == "application/json"
    assert response.headers["content-type"] == "application/json"
    assert response.headers["retry-after"] == "7"
    assert orjson.loads(response.body) == error.body()
    ErrorBody.model_validate(orjson.loads(response.body))  # the documented schema


def test_busy_is_a_429_queue_full_by_default_and_503_unavailable() -> None:
    full = busy("the queue is full")
    assert (full.status, full.code, full.headers) == (429, "queue_full", {"Retry-After": "1"})
    assert full.body()["error"] == {
        "message": "the queue is full",
        "type": "rate_limit_error",
        "param": None,
        "code": "queue_full",
    }
    loading = busy("the models are still loading", status=503)
    assert (loading.status, loading.code, loading.headers) == (
        503,
        "unavailable",
        {"Retry-After": "1"},
    )
    assert loading.body()["error"]["type"] == "server_error"
    assert loading.response().headers["retry-after"] == "1"


def test_error_event_is_one_sse_data_line_with_the_body() -> None:
    error = APIError(500, "the model failed", code="model_error")
    event = error_event(error)
    assert event == b"data: " + orjson.dumps(error.body()) + b"\n\n"
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n") and event.count(b"\n") == 2
    assert orjson.loads(event.removeprefix(b"data: ")) == error.body()


def test_error_responses_document_each_status_with_the_error_body() -> None:
    assert error_responses() == {}
    assert error_responses(400, 503) == {
        400: {"model": ErrorBody, "description": ERROR_DESCRIPTIONS[400]},
        503: {"model": ErrorBody, "description": ERROR_DESCRIPTIONS[503]},
    }
    with pytest.raises(KeyError):
        error_responses(418)


# ---- validation_error: pydantic's complaints as one 400 ------------------------------------


def complaint(loc: tuple, msg: str, kind: str = "value_error", **extra: Any) -> dict[str, Any]:
    return {"type": kind, "loc": loc, "msg": msg, "input": None, **extra}


def test_the_first_bad_field_is_named_with_its_reason() -> None:
    error = validation_error(
        [
            complaint(("body", "top_p"), "Input should be less than or equal to 1"),
            complaint(("body", "temperature"), "Input should be a valid number"),
        ]
    )
    assert error.status == 400 and error.param == "top_p" and error.code == "invalid_value"
    assert error.message == "top_p: Input should be less than or equal to 1"
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_a_union_fields_alternatives_are_joined_with_or() -> None:
    error = validation_error(
        [
            complaint(("body", "prompt", "str"), "Input should be a valid string"),
            complaint(("body", "seed"), "Input should be a valid integer"),
            complaint(("body", "prompt", "list[int]"), "Input should be a valid list"),
            complaint(("body", "prompt", "list[int]"), "Input should be a valid list"),  # again
        ]
    )
    assert error.param == "prompt"
    assert error.message == "prompt: Input should be a valid string or Input should be a valid list"


def test_value_errors_lose_pydantics_prefix() -> None:
    error = validation_error([complaint(("body", "stop"), "Value error, at most 4 stop strings")])
    assert error.message == "stop: at most 4 stop strings"
    prefix_inside = validation_error([complaint(("body", "n"), "not a Value error, here")])
    assert prefix_inside.message == "n: not a Value error, here"


def test_a_complaint_without_location_is_skipped_when_joining() -> None:
    errors = [complaint(("body", "top_k"), "too big"), {"type": "x", "msg": "no location"}]
    assert validation_error(errors).message == "top_k: too big"


def test_an_integer_location_is_named_as_text() -> None:
    error = validation_error([complaint(("body", 0), "bad item")])
    assert error.param == "0" and error.message == "0: bad item"


def test_invalid_json_quotes_the_parsers_reason() -> None:
    error = validation_error(
        [complaint(("body", 12), "JSON decode error", "json_invalid", ctx={"error": "bad byte"})]
    )
    assert (error.status, error.param, error.code) == (400, None, "invalid_json")
    assert error.message == "the request body is not valid JSON: bad byte"
    without_reason = validation_error([complaint(("body", 1), "JSON decode error", "json_invalid")])
    assert without_reason.message == "the request body is not valid JSON: malformed JSON"


@pytest.mark.parametrize("loc", [("body",), (), None])
def test_a_body_that_is_not_an_object_is_invalid_body(loc: tuple | None) -> None:
    error = complaint(loc or (), "Input should be a valid dictionary", "model_attributes_type")
    if loc is None:
        del error["loc"]
    shaped = validation_error([error])
    assert (shaped.status, shaped.param, shaped.code) == (400, None, "invalid_body")
    assert shaped.message == "the request body must be a JSON object"


# ---- the handlers, in a small app of their own ---------------------------------------------


class Body(BaseModel):
    prompt: str | list[int]
    top_p: float = Field(1.0, gt=0, le=1)
    temperature: float = 1.0


def small_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    document_errors(app)

    @app.post("/echo", responses=error_responses(400, 503))
    async def echo(body: Body) -> dict[str, Any]:
        return body.model_dump()

    @app.get("/api-error")
    async def api_error() -> None:
        raise APIError(429, "full", code="queue_full", headers={"Retry-After": "1"})

    @app.get("/http-error")
    async def http_error() -> None:
        raise HTTPException(409, "it clashed", headers={"X-Why": "because"})

    return app


# Function-scoped (cheap): mutmut credits a test with calling install_error_handlers only if
# the app is built during that test, so a module-scoped app would hide its handlers' mutants.
@pytest.fixture
def small() -> TestClient:
    return TestClient(small_app(), raise_server_exceptions=False)


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    ErrorBody.model_validate(body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_an_api_error_raised_in_a_route_is_answered_as_it_says(small: TestClient) -> None:
    response = small.get("/api-error")
    assert error_of(response, 429) == {
        "message": "full",
        "type": "rate_limit_error",
        "param": None,
        "code": "queue_full",
    }
    assert response.headers["retry-after"] == "1"


def test_a_validation_error_is_a_400_not_a_422(small: TestClient) -> None:
    error = error_of(small.post("/echo", json={"prompt": "a", "top_p": 2}), 400)
    assert error["param"] == "top_p" and error["code"] == "invalid_value"
    assert error["message"] == "top_p: Input should be less than or equal to 1"
    error = error_of(small.post("/echo", json={"prompt": 3}), 400)
    assert error["message"] == (
        "prompt: Input should be a valid string or Input should be a valid list"
    )
    error = error_of(small.post("/echo", json=[1]), 400)
    assert error["code"] == "invalid_body" and error["param"] is None
    headers = {"content-type": "application/json"}
    error = error_of(small.post("/echo", content=b'{"prompt": ', headers=headers), 400)
    assert error["code"] == "invalid_json"
    assert error["message"].startswith("the request body is not valid JSON: ")
    assert small.post("/echo", json={"prompt": [1, 2]}).status_code == 200


def test_http_errors_keep_their_status_detail_and_headers(small: TestClient) -> None:
    response = small.get("/http-error")
    error = error_of(response, 409)
    assert error["message"] == "it clashed" and error["type"] == "server_error"
    assert response.headers["x-why"] == "because"


def test_a_404_names_the_path_and_a_405_keeps_allow(small: TestClient) -> None:
    error = error_of(small.get("/no/such/thing"), 404)
    assert error == {
        "message": "no route /no/such/thing",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    response = small.delete("/echo")
    error = error_of(response, 405)
    assert error["message"] == "Method Not Allowed" and error["type"] == "invalid_request_error"
    assert response.headers["allow"] == "POST"


def test_the_schema_documents_no_422_and_keeps_the_rest() -> None:
    app = small_app()
    schema = app.openapi()
    responses = schema["paths"]["/echo"]["post"]["responses"]
    assert set(responses) == {"200", "400", "503"}
    assert responses["400"]["description"] == ERROR_DESCRIPTIONS[400]
    assert responses["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorBody"
    }
    schemas = schema["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    assert {"Body", "ErrorBody", "ErrorDetail"} <= set(schemas)
    assert app.openapi() is schema and app.openapi_schema is schema  # built once
    assert TestClient(app).get("/openapi.json").json() == schema


def test_a_schema_without_paths_or_components_is_fine() -> None:
    app = FastAPI()
    document_errors(app)
    schema = app.openapi()
    assert schema["paths"] == {} and "components" not in schema


@pytest.mark.parametrize(
    "generated",
    [
        {"openapi": "3.1.0", "info": {"title": "t", "version": "1"}},
        {"openapi": "3.1.0", "info": {}, "paths": {"/x": {"get": {}}}},
        {"paths": {"/x": {"get": {"responses": {"200": {}, "422": {}}}}}, "components": {}},
    ],
    ids=["no paths", "no responses", "no schemas"],
)
def test_document_errors_takes_whatever_schema_the_app_generates(generated: dict) -> None:
    """It wraps ``app.openapi`` as it finds it, which need not be FastAPI's own."""
    app = FastAPI()
    app.openapi = lambda: generated  # type: ignore[method-assign]
    document_errors(app)
    schema = app.openapi()
    assert schema is generated
    for path in schema.get("paths", {}).values():
        assert set(path["get"].get("responses", {})) <= {"200"}


# ---- through ordinal's own app, its models not loaded ---------------------------------------


@pytest.fixture
def ordinal(tmp_path: Path) -> TestClient:
    empty = tmp_path / "no-checkpoints"
    empty.mkdir()
    settings = Settings(checkpoints=empty, device="cpu", threads=1)
    return TestClient(create_app(settings), raise_server_exceptions=False)  # no lifespan


def test_ordinal_answers_errors_in_openai_shape(ordinal: TestClient) -> None:
    error = error_of(ordinal.post("/v1/completions", json={"prompt": "a", "top_p": 0}), 400)
    assert error["param"] == "top_p" and error["message"].startswith("top_p: ")
    error = error_of(ordinal.post("/v1/completions", json={"prompt": 7}), 400)
    assert error["param"] == "prompt" and " or " in error["message"]
    error = error_of(ordinal.get("/v1/nothing/here"), 404)
    assert error["message"] == "no route /v1/nothing/here"
    error_of(ordinal.put("/v1/completions", json={}), 405)
    response = ordinal.post("/v1/completions", json={"prompt": "a"})
    error = error_of(response, 503)
    assert error["code"] == "unavailable" and error["type"] == "server_error"
    assert response.headers["retry-after"] == "1"


def test_ordinals_schema_documents_errors_not_422(ordinal: TestClient) -> None:
    schema = ordinal.get("/openapi.json").json()
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation.get("responses", {}), (method, path)
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    for status in ("400", "429", "503"):
        content = completions[status]["content"]["application/json"]
        assert content["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
