"""The one place errors are shaped: OpenAI's ``{"error": {"message", "type", "param", "code"}}``,
and on Anthropic's routes (``/v1/messages``, :func:`is_anthropic`) Anthropic's
``{"type": "error", "error": {"type", "message"}}``, whose message starts with the field it is
about as OpenAI's ``param`` names it.

Routes raise :class:`APIError`; the handlers installed by :func:`install_error_handlers` turn it,
FastAPI's validation errors (400, not FastAPI's 422) and Starlette's HTTP errors into the
route's shape; any other exception is answered by ``server.api.middleware.CatchUnexpected`` as a
500 in the same shape. A stream that fails after its headers went out ends with
:func:`error_event` (a writer's own ``error_event`` for Anthropic's stream).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.responses import Response

from server.api.sse import sse_event

logger = logging.getLogger("ordinal.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


# Anthropic's error types by status (its API reference's "Errors"); 503 (loading, restarting,
# shutting down) as its 529, overloaded.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
ANTHROPIC_ROUTE = "/v1/messages"  # and what is under it (/v1/messages/count_tokens)


def is_anthropic(path: str) -> bool:
    """Whether ``path`` is one of Anthropic's routes, whose errors take Anthropic's shape."""
    return path == ANTHROPIC_ROUTE or path.startswith(ANTHROPIC_ROUTE + "/")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error's body, as OpenAI answers it (the OpenAPI schema of each error status)."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """Every error's body on Anthropic's routes, as Anthropic answers it."""

    type: Literal["error"]
    error: AnthropicErrorDetail


ERROR_DESCRIPTIONS = {
    400: "Invalid request: a field is wrong (``param`` names it) or the body is not JSON",
    401: "Missing or wrong API key (only when the server has one)",
    403: "A priority more urgent than the caller may claim (--max-priority, --priority-keys)",
    404: "No such model (or route)",
    413: "The request body is larger than the server's limit",
    429: "The model's queue is full; retry after the Retry-After header's seconds",
    500: "The model or its sampler failed on this request (other requests are unaffected)",
    503: "The model is loading, failed to load, or the server is shutting down",
    504: "The request took longer than the server's request timeout",
}


def error_responses(*statuses: int, anthropic: bool = False) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of a route that can answer ``statuses`` (in Anthropic's shape
    when ``anthropic``)."""
    body = AnthropicErrorBody if anthropic else ErrorBody
    return {
        status: {"model": body, "description": ERROR_DESCRIPTIONS[status]} for status in statuses
    }


class APIError(Exception):
    """An error answered to the client: HTTP status, message and the request field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        """The error in Anthropic's shape (its message already names the field at fault)."""
        kind = ANTHROPIC_ERROR_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str = "") -> Response:
        """The answer to a request for ``path``: Anthropic's shape on its routes, else OpenAI's."""
        body = self.anthropic_body() if is_anthropic(path) else self.body()
        return Response(
            orjson.dumps(body),
            status_code=self.status,
            headers=self.headers,
            media_type="application/json",
        )


def too_long(text: str, tokens: int, taker: str, limit: int, param: str, why: str = "") -> APIError:
    """The 400 (``context_length_exceeded``) for ``text`` (the request's field, in prose) of
    ``tokens`` tokens where ``taker`` takes at most ``limit``; ``why`` follows the limit."""
    return APIError(
        400,
        f"{text} is {tokens} tokens long (a text counts its <|bos|>) but {taker} takes at most "
        f"{limit}{why}",
        param=param,
        code="context_length_exceeded",
    )


def busy(message: str, status: int = 429) -> APIError:
    """Queue full (429) or not ready (503): the client should retry after a second."""
    code = "queue_full" if status == 429 else "unavailable"
    return APIError(status, message, code=code, headers={"Retry-After": "1"})


def error_event(error: APIError) -> bytes:
    """The SSE event that ends a stream which fails after it started."""
    return sse_event(error.body())


def validation_error(errors: list[dict]) -> APIError:
    """A 400 naming the first bad top-level field of the body, with every complaint about it.

    A union field (``prompt``) fails once per alternative; those messages are joined with "or".
    """
    first = errors[0]
    location = first.get("loc", ())
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", "malformed JSON")
        return APIError(400, f"the request body is not valid JSON: {reason}", code="invalid_json")
    if len(location) < 2:  # the body itself: missing, or not an object
        return APIError(400, "the request body must be a JSON object", code="invalid_body")
    param = str(location[1])
    about = [e for e in errors if tuple(map(str, e.get("loc", ())))[1:2] == (param,)]
    reasons = [_reason(e) for e in about]
    message = f"{_field_path([e.get('loc', ())[1:] for e in about])}: " + " or ".join(
        dict.fromkeys(reasons)
    )
    return APIError(400, message, param=param, code="invalid_value")


def _field_path(locations: list[tuple[Any, ...]]) -> str:
    """The innermost field every complaint is about, as ``stream_options.include_usage`` or
    ``messages[0].content``: the path the locations share (a union's alternatives each add
    their type's name, where they part ways, so the field is where they still agree)."""
    shared = list(locations[0])
    for location in locations[1:]:
        common = 0
        while common < min(len(shared), len(location)) and shared[common] == location[common]:
            common += 1
        del shared[common:]
    path = str(shared[0])
    for step in shared[1:]:
        path += f"[{step}]" if isinstance(step, int) else f".{step}"
    return path


def _reason(error: dict) -> str:
    return str(error["msg"]).removeprefix("Value error, ")


def document_errors(app: FastAPI) -> None:
    """Make ``/openapi.json`` tell the truth: FastAPI documents a 422 on every route with a
    body, which this server never sends (its validation errors are 400, in ``ErrorBody``)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _log_refusal(request: Request, error: APIError) -> None:
    """Say in the server's log why a request was refused (the access line gives only the
    status): an operator reading it sees what the client got wrong without asking them."""
    if 400 <= error.status < 500 and error.status != 429:  # 429s: counted, not logged
        logger.info(
            "refused %s %s: %d %s", request.method, request.url.path, error.status, error.message
        )


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error raised while handling a request in OpenAI's shape."""

    # The decorator, not add_exception_handler: that one's type wants handlers of any Exception.
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, error: APIError) -> Response:
        _log_refusal(request, error)
        return error.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, error: RequestValidationError) -> Response:
        refusal = validation_error(list(error.errors()))
        _log_refusal(request, refusal)
        return refusal.response(request.url.path)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, error: HTTPException) -> Response:
        message = str(error.detail) if error.status_code != 404 else f"no route {request.url.path}"
        refusal = APIError(error.status_code, message, headers=error.headers)
        return refusal.response(request.url.path)
