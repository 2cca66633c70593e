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

import base64
import math
from typing import Any, Protocol

import numpy as np
import torch
from pydantic import BaseModel, Field
from torch import Tensor

from model.positional import positions_table
from model.sampling import sampling_stages
from model.transformer import AttentionRecorder, Intervention, Transformer
from server.api.completions import prompt_ids_of
from server.api.errors import APIError
from server.api.schemas import DEFAULT_LENS_TOP, MAX_TRACE_TOKENS, TraceRequest
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
    logit_lens: TraceLens | None = Field(description="null unless the request's logit_lens is true")


# ---- computing it ---------------------------------------------------------------------------


async def create_trace(body: TraceRequest, served: ServedModel) -> bytes:
    """The JSON of :class:`TraceResponse` for ``body`` (400 if the prompt is too long)."""
    prompt_ids = prompt_ids_of(body.prompt, served)
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
    check_interventions(body, served, len(prompt_ids))
    return await served.engine.trace(prompt_ids, body.model_dump_json().encode())


def check_interventions(body: TraceRequest, served: ServedModel, length: int) -> None:
    """A 400 naming the field for a layer or head the model lacks, or an offset that takes the
    last of ``length`` positions past the scheme's table (as a too-long prompt would)."""
    info = served.info
    for index, ref in enumerate(body.ablate):
        for field, value, count in (
            ("layer", ref.layer, info.n_layers),
            ("head", ref.head, info.n_heads),
        ):
            if value >= count:
                raise APIError(
                    400,
                    f"ablate[{index}].{field} is {value}, but model '{served.name}' has "
                    f"{count} {field}s (0..{count - 1})",
                    param="ablate",
                )
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
    intervention = intervention_of(body, model.config.n_layers)
    positions = positions_table(len(prompt_ids), device) + body.position_offset  # [1, T]
    scheme = model.positional
    with torch.inference_mode():
        recorder = AttentionRecorder() if body.attention or body.logit_lens else None
        logits = model(ids.unsqueeze(0), recorder=recorder, intervention=intervention)
        logits = logits[0, :, :vocab].float()  # [T, V]
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
        "positions": positions[0].tolist(),
        "embedding": {
            "token_norm": _array(token_vectors.norm(dim=-1)),
            "position_norm": None if vectors is None else _array(vectors.norm(dim=-1)),
            "position_vectors": None if vectors is None else _rounded(vectors),
        },
        # [L, H, T, T] (a batch of one)
        **_attention(recorder.weights if recorder and body.attention else None, body),
        "position_bias": None if bias is None else _lower_triangle(bias[0].float()),
        "rotation": None if rotation is None else _angles(rotation),
        "next_token": {
            "greedy": params.greedy,
            "stages": [_stage(stage.name, stage.probs, top, names) for stage in stages],
        },
        "surprisal": [None, *(-logprobs.cpu() / math.log(2)).tolist()],
        "logit_lens": _lens(model, recorder.residuals, vocab, names)
        if recorder is not None and body.logit_lens
        else None,
    }


def _attention(weights: list[Tensor] | None, body: TraceRequest) -> dict[str, Any]:
    """The attention fields: each layer's weights [1, H, T, T] as rounded lists or as uint8."""
    if weights is None:
        return {"attention": None, "attention_uint8": None}
    stacked = torch.cat(weights)  # [L, H, T, T] (a batch of one)
    if body.attention_encoding == "lists":
        return {"attention": _lower_triangle(stacked), "attention_uint8": None}
    length = stacked.shape[-1]
    rows, keys = torch.tril_indices(length, length)  # row-major: query q's keys 0..q in turn
    levels = (stacked[..., rows, keys] * 255).round().to(torch.uint8)  # [L, H, T(T+1)/2]
    return {
        "attention": None,
        "attention_uint8": base64.b64encode(levels.cpu().numpy().tobytes()).decode(),
    }


def intervention_of(body: TraceRequest, n_layers: int) -> Intervention | None:
    """The request's changes to the forward pass, or None when it asks for none."""
    dropped = range(n_layers) if body.drop_positional == "all" else body.drop_positional
    if not (body.position_offset or body.ablate or dropped):
        return None
    return Intervention(
        position_offset=body.position_offset,
        ablate=frozenset((ref.layer, ref.head) for ref in body.ablate),
        drop_positional=frozenset(dropped),
    )


def _lens(
    model: Transformer, residuals: list[Tensor], vocab: int, names: list[str]
) -> dict[str, Any]:
    """Each block's output [1, T, d] through the final norm and the unembedding: per layer and
    position the DEFAULT_LENS_TOP most probable tokens (the last layer's are the served ones)."""
    with torch.inference_mode():
        logits = model.unembed(torch.cat(residuals))[..., :vocab].float()  # [L, T, V]
        probs, ids = logits.softmax(dim=-1).topk(min(DEFAULT_LENS_TOP, vocab), dim=-1)
    return {
        "ids": ids.cpu().numpy().astype(np.int32),
        "probs": _array(probs),
        "texts": [[[names[token] for token in row] for row in layer] for layer in ids.tolist()],
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
