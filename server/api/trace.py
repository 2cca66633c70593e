"""``POST /v1/trace``: one prompt through the pipeline, every intermediate the playground draws.

One forward pass of the served model — the same ``Transformer.forward`` the engine decodes with,
given an :class:`~model.transformer.AttentionRecorder` — yields the logits at every position and
each layer's attention weights. The positional pieces come from the model's own scheme module
(``embedding``, ``rotation``, ``attention_bias``), and the next-token stages from
:func:`model.sampling.sampling_stages`, which runs the sampler's own filter steps. Nothing here
re-implements a part of the model.

The forward runs in the engine process (``server.engine.core``), the only process that holds the
weights, between two decode steps: the streams decoding meanwhile wait for one forward of at
most :data:`~server.api.schemas.MAX_TRACE_TOKENS` tokens. The API process checks the prompt and
receives the JSON, already written.

Response size: attention holds layers × heads × T(T+1)/2 weights, so it is sent as the causal
lower triangle only (row q lists keys 0..q), as is alibi's and t5's bias; those matrices and the
positional vectors are rounded to :data:`SIGNIFICANT_DIGITS` significant digits (a relative error
of at most 5e-4, far below what a heatmap shows; a row of weights still sums to 1 within 1e-3).
The small fields (norms, rotation angles, stage probabilities, surprisal) stay exact float32.
For the shipped models (4 layers, 4 heads, d_model 128), bytes of JSON for rope / alibi:

======  =======================  ======================  ===================
tokens  before (full T×T, f32)   now                     now, attention off
======  =======================  ======================  ===================
19      54 kB / 60 kB            32 kB / 33 kB           6.5 kB / 9.2 kB
128     2.26 MB / 2.64 MB        1.24 MB / 1.42 MB       29 kB / 246 kB
256     9.07 MB / 10.7 MB        5.01 MB / 5.83 MB       55 kB / 950 kB
======  =======================  ======================  ===================

The limit stays at 256 so that the Generate view's alternatives (prompt + default 120 tokens)
are traced on the whole prefix the sampler saw; the views that draw no attention ask with
``attention: false``.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np
import torch
from pydantic import BaseModel, Field
from torch import Tensor

from model.positional import positions_table
from model.sampling import sampling_stages
from model.transformer import AttentionRecorder, Transformer
from server.api.completions import prompt_ids_of
from server.api.errors import APIError
from server.api.schemas import MAX_TRACE_TOKENS, TraceRequest
from server.api.service import ServedModel

SIGNIFICANT_DIGITS = 4  # of the attention weights, the biases and the positional vectors

# ---- the response, as documented in the OpenAPI spec ---------------------------------------


class TraceToken(BaseModel):
    id: int
    text: str = Field(description="the token as logprobs name it (specials by name)")


class TraceEmbedding(BaseModel):
    token_norm: list[float] = Field(description="[T] ‖token embedding‖ per position")
    position_norm: list[float] | None = Field(
        description="[T] ‖positional vector‖ per position; null unless the scheme adds one"
    )
    position_vectors: list[list[float]] | None = Field(
        description="[T][d_model] the vector added at each position (4 significant digits); "
        "null unless additive"
    )


class StageToken(BaseModel):
    id: int
    text: str
    prob: float


class TraceStage(BaseModel):
    name: str = Field(
        description="logits (softmax of the raw logits), repetition_penalty, temperature, "
        "top_k, top_p or min_p — in the order the sampler applies them"
    )
    kept: int = Field(description="tokens with non-zero probability after this stage")
    top: list[StageToken] = Field(description="the most probable tokens (non-zero), descending")


class TraceNextToken(BaseModel):
    greedy: bool = Field(description="temperature below 1e-5: the argmax is taken")
    stages: list[TraceStage] = Field(
        description="the last stage is the distribution /v1/completions draws from"
    )


class TraceResponse(BaseModel):
    """What one forward pass over the prompt shows (T = prompt tokens, counting <|bos|>)."""

    object: str = "trace"
    model: str
    scheme: str
    context_length: int = Field(description="the length the model was trained at")
    limit: int = Field(description="the most tokens a trace of this model takes")
    n_layers: int
    n_heads: int
    tokens: list[TraceToken]
    positions: list[int]
    embedding: TraceEmbedding
    attention: list[list[list[list[float]]]] | None = Field(
        description="[layers][heads][T][q+1] softmax weights, the causal lower triangle: row q "
        "lists keys 0..q (the masked keys after q have weight 0 and are left out) and sums to 1; "
        "4 significant digits; null when the request's attention is false"
    )
    position_bias: list[list[list[float]]] | None = Field(
        description="[heads][T][q+1] the additive score bias of alibi and t5, the causal lower "
        "triangle (row q lists keys 0..q; later keys are masked); 4 significant digits; null "
        "for the other schemes"
    )
    rotation: list[list[float]] | None = Field(
        description="[T][rotary_dim/2] rope's rotation angle in radians (unwrapped) per "
        "position and dimension pair; null for the other schemes"
    )
    next_token: TraceNextToken
    surprisal: list[float | None] = Field(
        description="[T] −log₂ p(token | prefix) of each prompt token (null for <|bos|>)"
    )


# ---- computing it ---------------------------------------------------------------------------


async def create_trace(body: TraceRequest, served: ServedModel) -> bytes:
    """The JSON of :class:`TraceResponse` for ``body`` (400 if the prompt is too long)."""
    prompt_ids = await prompt_ids_of(body.prompt, served)
    limit = trace_limit(served)
    if len(prompt_ids) > limit:
        raise APIError(
            400,
            f"the prompt is {len(prompt_ids)} tokens long (counting <|bos|>) but a trace of "
            f"model '{served.name}' takes at most {limit}",
            param="prompt",
            code="context_length_exceeded",
        )
    body.sampling_params(served.vocab)  # a bad field is a 400 here, not a failure in the engine
    return await served.engine.trace(prompt_ids, body.model_dump_json().encode())


class Traceable(Protocol):
    """A model as the engine process holds it (``server.engine.loader.LoadedModel``)."""

    name: str
    model: Transformer
    token_strings: list[str]
    max_context: int

    @property
    def vocab(self) -> int: ...


def trace_limit(served: ServedModel | Traceable) -> int:
    """At most MAX_TRACE_TOKENS, and never past what the model serves."""
    return min(MAX_TRACE_TOKENS, served.max_context)


def trace_document(body: TraceRequest, served: Traceable, prompt_ids: list[int]) -> dict[str, Any]:
    """The trace of ``prompt_ids`` (already checked against :func:`trace_limit`), as a dict
    orjson writes (numpy arrays included). Runs in the engine process, beside the decode loop."""
    model, vocab, names = served.model, served.vocab, served.token_strings
    device = next(model.parameters()).device
    ids = torch.tensor(prompt_ids, device=device)  # [T]
    positions = positions_table(len(prompt_ids), device)  # [1, T]
    scheme = model.positional
    with torch.inference_mode():
        recorder = AttentionRecorder() if body.attention else None
        logits = model(ids.unsqueeze(0), recorder=recorder)[0, :, :vocab].float()  # [T, V]
        token_vectors = model.token_embedding(ids).float()  # [T, d_model]
        position_vectors = scheme.embedding(positions)  # [1, T, d_model] or None
        rotation = scheme.rotation(positions)  # (cos, sin) [1, 1, T, rot] or None
        bias = scheme.attention_bias(positions, positions[0])  # [1, H, T, T] or None

        seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=device)
        seen[ids] = True
        params = body.sampling_params(vocab)
        stages = sampling_stages(logits[-1], params, seen)
        logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[1:, None])[:, 0]

    top = min(body.top, vocab)
    vectors = None if position_vectors is None else position_vectors[0].float()
    return {
        "object": "trace",
        "model": served.name,
        "scheme": model.config.scheme,
        "context_length": model.config.context_length,
        "limit": trace_limit(served),
        "n_layers": model.config.n_layers,
        "n_heads": model.config.n_heads,
        "tokens": [{"id": token, "text": names[token]} for token in prompt_ids],
        "positions": list(range(len(prompt_ids))),
        "embedding": {
            "token_norm": _array(token_vectors.norm(dim=-1)),
            "position_norm": None if vectors is None else _array(vectors.norm(dim=-1)),
            "position_vectors": None if vectors is None else _rounded(vectors),
        },
        # [L, H, T, T] (a batch of one)
        "attention": None if recorder is None else _lower_triangle(torch.cat(recorder.weights)),
        "position_bias": None if bias is None else _lower_triangle(bias[0].float()),
        "rotation": None if rotation is None else _angles(rotation),
        "next_token": {
            "greedy": params.greedy,
            "stages": [_stage(stage.name, stage.probs, top, names) for stage in stages],
        },
        "surprisal": [None, *(-logprobs.cpu() / math.log(2)).tolist()],
    }


def _array(tensor: Tensor) -> np.ndarray:
    """float32 on the host: orjson writes each float32 in its shortest form."""
    return np.ascontiguousarray(tensor.detach().to("cpu", torch.float32).numpy())


def round_significant(values: np.ndarray, digits: int = SIGNIFICANT_DIGITS) -> np.ndarray:
    """``values`` rounded to ``digits`` significant digits, as float32 (whose shortest form,
    which orjson writes, is then at most ``digits`` digits long). Zeros and NaN stay as they are.
    """
    wide = values.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        magnitude = np.floor(np.log10(np.abs(wide)))
    magnitude[~np.isfinite(magnitude)] = 0  # zeros (and NaN, which stays NaN)
    scale = 10.0 ** (digits - 1 - magnitude)
    return (np.round(wide * scale) / scale).astype(np.float32)


def _rounded(tensor: Tensor) -> np.ndarray:
    return round_significant(_array(tensor))


def _lower_triangle(matrices: Tensor) -> list[Any]:
    """[..., T, T] → nested lists [...][T] of rows, row q holding columns 0..q (rounded).

    orjson writes each row, a float32 array, directly; the leading dimensions become lists."""
    values = _rounded(matrices)
    length = values.shape[-1]
    flat = values.reshape(-1, length, length)
    rows = [[square[q, : q + 1] for q in range(length)] for square in flat]
    shaped: list[Any] = rows
    for size in reversed(values.shape[:-2][1:]):
        shaped = [shaped[i : i + size] for i in range(0, len(shaped), size)]
    return shaped


def _angles(rotation: tuple[Tensor, Tensor]) -> np.ndarray:
    """The rotation's angle per position and pair → [T, rot/2] radians.

    cos/sin [1, 1, T, rot] in the NeoX half-split layout (the pair i is columns i and
    i + rot/2). atan2 gives each angle modulo 2π; unwrapping along positions recovers
    position × frequency, since no frequency turns by π or more in one position.
    """
    cos, sin = (part[0, 0].float().cpu() for part in rotation)
    half = cos.shape[-1] // 2
    wrapped = torch.atan2(sin[:, :half], cos[:, :half]).double().numpy()
    return np.unwrap(wrapped, axis=0).astype(np.float32)


def _stage(name: str, probs: Tensor, top: int, names: list[str]) -> dict[str, Any]:
    """One stage: probs [V] → its kept count and its ``top`` most probable non-zero tokens."""
    probs = probs.cpu()
    values, ids = probs.topk(top)
    shown = [
        {"id": token, "text": names[token], "prob": value}
        for value, token in zip(values.tolist(), ids.tolist(), strict=True)
        if value > 0
    ]
    return {"name": name, "kept": int((probs > 0).sum()), "top": shown}
