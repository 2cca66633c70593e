"""Server-sent events as OpenAI's streaming API frames them: ``data: JSON`` and a blank line."""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"  # the event that ends every stream


def sse_event(document: Any) -> bytes:
    """One event carrying ``document`` as JSON."""
    return b"data: " + orjson.dumps(document) + b"\n\n"
