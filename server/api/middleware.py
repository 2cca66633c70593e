"""Pure ASGI middleware: request counting, unexpected errors, the API key, the body limit and the
``Host`` allow-list.

Pure ASGI (not BaseHTTPMiddleware) so that streamed responses pass through untouched.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets

from prometheus_client import Counter
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.errors import APIError

logger = logging.getLogger("ordinal.server")


class CountRequests:
    """Counts every answered HTTP request by route template and status code (the template, not
    the raw path, so a scan of random paths cannot grow the label set)."""

    def __init__(self, app: ASGIApp, counter: Counter) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")  # set by the router once a route matched
                template = getattr(route, "path", None) or "unmatched"
                self.counter.labels(template, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class CatchUnexpected:
    """Answers any exception that escaped the routes' error handlers with a 500 in the route's
    error shape, and does not re-raise it.

    Starlette's own last-resort handler re-raises after answering, which makes the server drop
    the keep-alive connection without ``Connection: close`` (and, outside ``CountRequests``,
    leaves the answer uncounted). A response that had already started (a stream) cannot be
    replaced: the connection is then closed, which tells the client the body is incomplete.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watching_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        except Exception:
            logger.exception("unhandled error on %s", scope.get("path"))
            if not started:
                error = APIError(500, "internal server error")
                await error.response(scope["path"])(scope, receive, send)


def presented_key(headers: Headers) -> bytes:
    """The API key a request presents: ``Authorization: Bearer KEY``, as OpenAI's clients send
    it, else ``x-api-key: KEY``, as Anthropic's clients do (b"" when neither is there)."""
    bearer = headers.get("authorization", "")
    if bearer.startswith("Bearer "):
        return bearer.removeprefix("Bearer ").encode()
    return headers.get("x-api-key", "").encode()


class RequireApiKey:
    """401 for a protected request that presents none of ``keys`` (the API key, and the
    priority keys; :func:`presented_key`), before its body is read. ``scope`` "api" protects
    /v1/*; "all" every path but /health, which probes need, and the playground's page and
    static files (``GET /``, ``/static/*``: files of this repository, no data), which then ask
    for the key and send it with every request they make."""

    def __init__(self, app: ASGIApp, keys: list[str], scope: str = "api") -> None:
        self.app, self.everything = app, scope == "all"
        self.expected = [key.encode() for key in keys]

    def _protects(self, path: str) -> bool:
        if self.everything:
            return path not in ("/health", "/") and not path.startswith("/static/")
        return path.startswith("/v1/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._protects(scope["path"]):
            given = presented_key(Headers(scope=scope))
            if not any([secrets.compare_digest(given, key) for key in self.expected]):
                error = APIError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>' (or "
                    "'x-api-key: <key>')",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await error.response(scope["path"])(scope, receive, send)
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
            return await self._error().response(scope["path"])(scope, receive, send)
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


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def host_name(header: str) -> str:
    """The name of a ``Host`` header: "[::1]:8000" → "::1", "Example.COM.:80" → "example.com"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0].rstrip(".") if header.count(":") == 1 else header


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


class AllowHosts:
    """400 for a request whose ``Host`` is not served: a page that rebinds its own name to
    127.0.0.1 reaches a local server under that foreign name, which this refuses.

    ``allowed`` names the hosts served on every connection; empty, a connection that arrived
    on a loopback address (``scope["server"]``) is served under :data:`LOOPBACK_NAMES` only,
    and any other under any name (behind a proxy, the proxy's names are not known here).
    """

    def __init__(self, app: ASGIApp, allowed: list[str]) -> None:
        self.app, self.allowed = app, {host_name(name) for name in allowed}

    def _names(self, scope: Scope) -> set[str] | None:
        if self.allowed:
            return self.allowed
        server = scope.get("server")
        return set(LOOPBACK_NAMES) if server and is_loopback(str(server[0])) else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (names := self._names(scope)) is not None:
            given = Headers(scope=scope).get("host", "")
            if host_name(given) not in names:
                shown = given if len(given) <= 100 else given[:100] + "…"
                error = APIError(
                    400,
                    f"Host {shown!r} is not served here (allowed: {', '.join(sorted(names))}; "
                    "see --allowed-hosts)",
                    code="host_not_allowed",
                )
                return await error.response(scope["path"])(scope, receive, send)
        await self.app(scope, receive, send)
