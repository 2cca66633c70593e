"""Pure ASGI middleware: request counting, the API key and the body size limit.

Pure ASGI (not BaseHTTPMiddleware) so that streamed responses pass through untouched.
"""

from __future__ import annotations

import secrets

from prometheus_client import Counter
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError


class CountRequests:
    """Counts every answered HTTP request by status code."""

    def __init__(self, app: ASGIApp, counter: Counter) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class RequireApiKey:
    """401 for a /v1/ request without ``Authorization: Bearer <key>``, before its body is read."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self.expected):
                error = APIError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


class LimitBody:
    """413 for a body over ``max_bytes``: at once from Content-Length, else while it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _error(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_bytes} bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self._error().response()(scope, receive, send)
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                # FastAPI re-raises an HTTPException met while reading the body; the error
                # handlers then answer it in OpenAI's shape.
                raise HTTPException(413, self._error().message)
            return message

        await self.app(scope, limited_receive, send)
