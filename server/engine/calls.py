"""The engine's functions that compute with the weights but generate nothing, by name.

The API process asks for one with a :class:`~server.messages.Call` (method name and keyword
arguments, already checked there); :class:`~server.engine.core.EngineCore` runs it between two
decode steps and answers the JSON of what it returns. A new engine-backed endpoint is a route
and a schema in ``server.api``, and its function here.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import msgspec
import orjson
import torch
from torch import Tensor

from model.sampling_params import SamplingParams
from model.transformer import AttentionRecorder, Transformer
from server.engine.explain import patch_effects
from server.engine.loader import LoadedModel
from server.engine.trace import trace_document


def trace(loaded: LoadedModel, params: dict[str, Any], **args: Any) -> dict[str, Any]:
    """``POST /v1/trace`` (``server.engine.trace``)."""
    return trace_document(loaded, params=msgspec.convert(params, SamplingParams), **args)


def embed(
    loaded: LoadedModel,
    inputs: list[list[int]],
    layer: int | None,
    pooling: str,
    encoding_format: str,
) -> dict[str, Any]:
    """``POST /v1/embeddings`` (``server.api.embeddings``): OpenAI's response, each input's
    hidden state at ``layer`` pooled over its positions (``mean`` or ``last``), from one
    uncached forward pass of its own."""
    model = loaded.model
    device = next(model.parameters()).device
    data = []
    with torch.inference_mode():
        for index, ids in enumerate(inputs):
            hidden = hidden_state(model, torch.tensor([ids], device=device), layer)[0]  # [T, d]
            pooled = hidden.float().mean(dim=0) if pooling == "mean" else hidden[-1].float()
            # float32: orjson writes each number in its shortest form
            embedding: Any = pooled.cpu().numpy()
            if encoding_format == "base64":
                embedding = base64.b64encode(embedding.astype("<f4").tobytes()).decode()
            data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = sum(map(len, inputs))
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": loaded.name, "usage": usage}


def hidden_state(model: Transformer, tokens: Tensor, layer: int | None) -> Tensor:
    """The residual stream of ``tokens`` [1, T] → [1, T, d_model] at ``layer``: 0 the
    embeddings entering block 0, k block k's output, None the final norm's output (what the
    logits are read from); the trace's uncached pass computes it."""
    if layer == 0:
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        return model.embed(tokens, positions)
    recorder = AttentionRecorder(weights=False)
    model.traced_forward(tokens, recorder)
    if layer is None:
        return model.final_norm(recorder.residuals[-1])
    return recorder.residuals[layer - 1]


def patch(
    loaded: LoadedModel,
    clean: list[int],
    corrupted: list[int],
    target: int | None,
    sites: list[tuple[int, int]],
) -> dict[str, Any]:
    """``POST /v1/patch``, a share of its sites (``server.api.explain``)."""
    return patch_effects(loaded.model, loaded.vocab, clean, corrupted, target, sites)


CALLS: dict[str, Callable[..., dict[str, Any]]] = {"trace": trace, "embed": embed, "patch": patch}


def run_call(loaded: LoadedModel, method: str, args: dict[str, Any]) -> bytes:
    """The JSON of ``CALLS[method](loaded, **args)`` (numpy arrays written as lists)."""
    return orjson.dumps(CALLS[method](loaded, **args), option=orjson.OPT_SERIALIZE_NUMPY)
