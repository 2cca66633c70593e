"""Connections that cannot use up the server: a header timeout and a connection limit.

uvicorn closes a keep-alive connection that stays idle ``--keep-alive-timeout`` seconds after a
response, but not one that never sends a request, or stops in the middle of its headers: each
holds an open file forever, and at the process's open-file limit ``accept`` fails for everyone,
``/health`` included, without a log line. :func:`guarded_protocol` gives uvicorn an HTTP protocol
that

- closes a connection that has not sent a whole request head within ``header_timeout`` seconds
  of opening (or of its last response);
- keeps at most ``limit`` connections open: past it, the connection idle the longest (no
  request in flight) is closed to make room, so a new one — a probe's ``/health`` — is served,
  and a warning says so (at most once per :data:`LOG_EVERY` seconds, with the count).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger("ordinal.server")

RESERVED_FILES = 64  # open files kept for the server itself: engine socket, checkpoints, logs
LOG_EVERY = 5.0  # seconds between two warnings about closed connections


def default_limit() -> int:
    """The open-file limit less :data:`RESERVED_FILES` (at least 1)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(1, soft - RESERVED_FILES) if soft != resource.RLIM_INFINITY else 65_536


class _Refusals:
    """Connections closed to make room, counted between two log lines."""

    def __init__(self) -> None:
        self.unlogged = 0
        self.logged_at = 0.0

    def record(self, limit: int) -> None:
        self.unlogged += 1
        now = time.monotonic()
        if now - self.logged_at >= LOG_EVERY:
            logger.warning(
                "connection limit (%d open) reached: closed %d idle connection(s) to make room",
                limit,
                self.unlogged,
            )
            self.unlogged, self.logged_at = 0, now


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header timeout and a connection limit (the class
    attributes, set by :func:`guarded_protocol`)."""

    limit = 1024
    header_timeout = 10.0
    refusals = _Refusals()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.idle_since = time.monotonic()
        self._header_timer: asyncio.TimerHandle | None = None

    @property
    def idle(self) -> bool:
        """No request in flight: closing it loses nothing."""
        return self.cycle is None or self.cycle.response_complete

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limit:
            self._make_room()
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        self.idle_since = time.monotonic()
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def _make_room(self) -> None:
        idle = [
            connection
            for connection in self.connections
            if isinstance(connection, GuardedProtocol)
            and connection is not self
            and connection.idle
        ]
        if not idle:
            return
        oldest = min(idle, key=lambda connection: connection.idle_since)
        oldest.transport.close()
        self.connections.discard(oldest)
        self.refusals.record(self.limit)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.idle and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(limit: int | None, header_timeout: float) -> type[GuardedProtocol]:
    """A :class:`GuardedProtocol` class for uvicorn's ``http`` option (``limit`` None: the
    :func:`default_limit`)."""
    attributes = {
        "limit": limit or default_limit(),
        "header_timeout": header_timeout,
        "refusals": _Refusals(),
    }
    return type("Guarded", (GuardedProtocol,), attributes)
