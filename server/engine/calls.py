"""The engine's functions that compute with the weights but generate nothing, by name.

The API process asks for one with a :class:`~server.messages.Call` (method name and keyword
arguments, already checked there); :class:`~server.engine.core.EngineCore` runs it between two
decode steps and answers the JSON of what it returns. A new engine-backed endpoint is a route
and a schema in ``server.api``, and its function here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import orjson

from model.sampling_params import SamplingParams
from server.engine.loader import LoadedModel
from server.engine.trace import trace_document


def trace(loaded: LoadedModel, params: dict[str, Any], **args: Any) -> dict[str, Any]:
    """``POST /v1/trace`` (``server.engine.trace``)."""
    return trace_document(loaded, params=msgspec.convert(params, SamplingParams), **args)


CALLS: dict[str, Callable[..., dict[str, Any]]] = {"trace": trace}


def run_call(loaded: LoadedModel, method: str, args: dict[str, Any]) -> bytes:
    """The JSON of ``CALLS[method](loaded, **args)`` (numpy arrays written as lists)."""
    return orjson.dumps(CALLS[method](loaded, **args), option=orjson.OPT_SERIALIZE_NUMPY)
