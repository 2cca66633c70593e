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

The playground asks for ``attention_encoding: "uint8"``: the same triangles as bytes (each weight
× 255, rounded), base64 — 0.76 MB of JSON for rope at 256 tokens instead of 4.9 MB, and the
whole trace answers in about 100 ms in-process (``bench/trace.py``); the API gzips it.

Interventions (``position_offset``, ``ablate``, ``drop_positional``) are a
:class:`~model.transformer.Intervention` handed to that same forward, and the logit lens reads
the recorder's residual streams through :meth:`~model.transformer.Transformer.unembed`: every
field of the response is that of the changed pass. Their limits (layers, heads, a table's last
row) are checked here, in the API process, from the model's ``ModelInfo``.

The limit stays at 256 so that the Generate view's alternatives (prompt + default 120 tokens)
are traced on the whole prefix the sampler saw; the views that draw no attention ask with
``attention: false``.
"""

from __future__ import annotations

from dataclasses import asdict

from pydantic import BaseModel, Field

from server.api.completions import prompt_ids_of
from server.api.errors import APIError, too_long
from server.api.explain import Attribution, ScoreParts, check_target
from server.api.schemas import DEFAULT_LENS_TOP, MAX_TRACE_TOKENS, HeadRef, TraceRequest
from server.api.service import ServedModel
from server.api.structured import compile_constraint

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
        description="logits (softmax of the raw logits), grammar (a constraint's mask), "
        "logit_bias, repetition_penalty, frequency_presence_penalty, temperature, top_k, top_p "
        "or min_p — in the order the sampler applies them"
    )
    kept: int = Field(description="tokens with non-zero probability after this stage")
    top: list[StageToken] = Field(description="the most probable tokens (non-zero), descending")


class TraceNextToken(BaseModel):
    greedy: bool = Field(description="temperature below 1e-5: the argmax is taken")
    stages: list[TraceStage] = Field(
        description="the last stage is the distribution /v1/completions draws from"
    )


class TraceLens(BaseModel):
    """Each layer's output read as the last layer's is (final norm, unembedding)."""

    ids: list[list[list[int]]] = Field(
        description="[layers][T][3] the most probable next tokens after each layer, descending; "
        "the last layer's are the served distribution's"
    )
    probs: list[list[list[float]]] = Field(description="[layers][T][3] their probabilities")
    texts: list[list[list[str]]] = Field(description="[layers][T][3] their text")


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
    attention_uint8: str | None = Field(
        description="with attention_encoding uint8: base64 of [layers][heads][T(T+1)/2] bytes, "
        "each weight × 255 rounded (±0.002), the lower triangles row by row (query 0's key 0, "
        "query 1's keys 0..1, ...); attention is then null"
    )
    position_bias: list[list[list[float]]] | None = Field(
        description="[heads][T][q+1] the additive score bias of alibi, t5 and fire, the causal "
        "lower triangle (row q lists keys 0..q; later keys are masked); 4 significant digits; "
        "null for the other schemes"
    )
    layer_bias: list[list[list[list[float]]]] | None = Field(
        description="[layers][heads][T][q+1] the score bias a data-dependent scheme (fox, cope) "
        "added in each layer, from that layer's own inputs, as the causal lower triangle; "
        "4 significant digits; null for the other schemes"
    )
    forget_gates: list[list[list[float]]] | None = Field(
        description="[layers][heads][T] fox's forget gate f_t in (0, 1) of each token: the key "
        "at j loses log f_t for every later token t up to the query; null for the other schemes"
    )
    contextual_positions: list[list[list[list[float]]]] | None = Field(
        description="[layers][heads][T][q+1] cope's position of key k seen from query q, the sum "
        "of its gates over keys k..q, as the causal lower triangle; 4 significant digits; null "
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
    logit_lens: TraceLens | None = Field(description="null unless the request's logit_lens is true")
    score_parts: ScoreParts | None = Field(description="null unless the request names a head")
    attribution: Attribution | None = Field(
        description="null unless the request's attribution is true"
    )


# ---- computing it ---------------------------------------------------------------------------


async def create_trace(body: TraceRequest, served: ServedModel) -> bytes:
    """The JSON of :class:`TraceResponse` for ``body`` (400 if the prompt is too long)."""
    prompt_ids = await prompt_ids_of(body.prompt, served)
    limit = trace_limit(served)
    if len(prompt_ids) > limit:
        raise too_long(
            "the prompt", len(prompt_ids), f"a trace of model '{served.name}'", limit, "prompt"
        )
    grammar = await compile_constraint(body.constraint(), served)
    # a bad field is a 400 here, not in the engine
    params = body.sampling_params(served.vocab, grammar=grammar)
    check_interventions(body, served, len(prompt_ids))
    n_layers = served.info.n_layers
    args = {
        "prompt_ids": prompt_ids,
        "params": asdict(params),
        "attention": body.attention,
        "top": body.top,
        "limit": limit,
        "position_offset": body.position_offset,
        "ablate": [(ref.layer, ref.head) for ref in body.ablate],
        "drop_positional": list(
            range(n_layers) if body.drop_positional == "all" else body.drop_positional
        ),
        "logit_lens": body.logit_lens,
        "lens_top": DEFAULT_LENS_TOP,
        "attention_encoding": body.attention_encoding,
        "score_parts": None if (ref := body.score_parts) is None else (ref.layer, ref.head),
        "attribution": body.attribution,
        "target": body.target,
    }
    return await served.engine.call("trace", args)


def check_interventions(body: TraceRequest, served: ServedModel, length: int) -> None:
    """A 400 naming the field for a layer or head the model lacks, or an offset that takes the
    last of ``length`` positions past the scheme's table (as a too-long prompt would)."""
    info = served.info
    if body.score_parts is not None:
        _check_head(body.score_parts, "score_parts", "score_parts", served)
    if body.target is not None and not body.attribution:
        raise APIError(
            400,
            "target names the token attribution explains: it needs attribution: true",
            param="target",
        )
    check_target(body.target, served)
    for index, ref in enumerate(body.ablate):
        _check_head(ref, f"ablate[{index}]", "ablate", served)
    if body.drop_positional != "all":
        for index, layer in enumerate(body.drop_positional):
            if layer >= info.n_layers:
                raise APIError(
                    400,
                    f"drop_positional[{index}] is {layer}, but model '{served.name}' has "
                    f"{info.n_layers} layers (0..{info.n_layers - 1})",
                    param="drop_positional",
                )
    last = body.position_offset + length - 1
    if info.max_positions is not None and last >= info.max_positions:
        raise APIError(
            400,
            f"position_offset {body.position_offset} puts the prompt's last token at position "
            f"{last}, out of range for the '{info.scheme}' scheme, which has a table of "
            f"max_positions={info.max_positions} (0..{info.max_positions - 1})",
            param="position_offset",
            code="context_length_exceeded",
        )


def _check_head(ref: HeadRef, where: str, param: str, served: ServedModel) -> None:
    """A 400 naming ``where`` (e.g. ``ablate[2].head``) for a layer or head the model lacks."""
    info = served.info
    for field, value, count in (
        ("layer", ref.layer, info.n_layers),
        ("head", ref.head, info.n_heads),
    ):
        if value >= count:
            raise APIError(
                400,
                f"{where}.{field} is {value}, but model '{served.name}' has "
                f"{count} {field}s (0..{count - 1})",
                param=param,
            )


def trace_limit(served: ServedModel) -> int:
    """At most MAX_TRACE_TOKENS, and never past what the model serves."""
    return min(MAX_TRACE_TOKENS, served.max_context)
