"""``POST /v1/trace``: one prompt through the pipeline, every intermediate the playground draws.

The forward runs in the engine process (``server.engine.trace``, the only process that holds the
weights), between two decode steps: the streams decoding meanwhile wait for one forward of at
most :data:`~server.api.schemas.MAX_TRACE_TOKENS` tokens. This module, in the API process,
checks the request, sends it as one engine :class:`~server.messages.Call` and answers the JSON
the engine wrote; it also documents the response (:class:`TraceResponse`).

Response size: attention holds layers × heads × T(T+1)/2 weights, so it is sent as the causal
lower triangle only (row q lists keys 0..q), as is alibi's and t5's bias; those matrices and the
positional vectors are rounded to 4 significant digits (``server.engine.trace``: a relative
error of at most 5e-4, far below what a heatmap shows; a row of weights still sums to 1 within
1e-3).
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

from dataclasses import asdict

from pydantic import BaseModel, Field

from server.api.completions import prompt_ids_of
from server.api.errors import APIError
from server.api.schemas import MAX_TRACE_TOKENS, TraceRequest
from server.api.service import ServedModel

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
    prompt_ids = prompt_ids_of(body.prompt, served)
    limit = trace_limit(served)
    if len(prompt_ids) > limit:
        raise APIError(
            400,
            f"the prompt is {len(prompt_ids)} tokens long (a text counts its <|bos|>) but a "
            f"trace of model '{served.name}' takes at most {limit}",
            param="prompt",
            code="context_length_exceeded",
        )
    params = body.sampling_params(served.vocab)  # a bad field is a 400 here, not in the engine
    args = {
        "prompt_ids": prompt_ids,
        "params": asdict(params),
        "attention": body.attention,
        "top": body.top,
        "limit": limit,
    }
    return await served.engine.call("trace", args)


def trace_limit(served: ServedModel) -> int:
    """At most MAX_TRACE_TOKENS, and never past what the model serves."""
    return min(MAX_TRACE_TOKENS, served.max_context)
