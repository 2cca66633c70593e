"""The compute half of ``POST /v1/trace`` (``server.api.trace`` documents the response): one
forward pass over the prompt, every intermediate the playground draws.

One forward pass of the served model — the same ``Transformer.forward`` the engine decodes with,
given an :class:`~model.transformer.AttentionRecorder` — yields the logits at every position and
each layer's attention weights. The positional pieces come from the model's own scheme module
(``embedding``, ``rotation``, ``attention_bias``), and the next-token stages from
:func:`model.sampling.sampling_stages`, which runs the sampler's own filter steps. Nothing here
re-implements a part of the model. The data-dependent schemes' pieces (fox's forget gates,
cope's contextual positions, and the bias each layer added) are what that forward recorded
(``AttentionRecorder.layer_biases``), with or without the attention weights. Sizes and
rounding: ``server.api.trace``'s docstring.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from model.grammar import constraint_of
from model.positional import positions_table
from model.positional.rotation import Rotation
from model.sampling import sampling_stages
from model.sampling_params import SamplingParams
from model.transformer import AttentionRecorder, Intervention, Transformer
from server.engine import explain

if TYPE_CHECKING:
    from server.engine.loader import LoadedModel

SIGNIFICANT_DIGITS = 4  # of the attention weights, the biases and the positional vectors


def trace_document(
    served: LoadedModel,
    prompt_ids: list[int],
    params: SamplingParams,
    attention: bool,
    top: int,
    limit: int,
    position_offset: int = 0,
    ablate: Sequence[Sequence[int]] = (),
    drop_positional: Sequence[int] = (),
    logit_lens: bool = False,
    lens_top: int = 3,
    attention_encoding: str = "lists",
    score_parts: tuple[int, int] | None = None,
    attribution: bool = False,
    target: int | None = None,
) -> dict[str, Any]:
    """The trace of ``prompt_ids`` (already checked against ``limit``, the most tokens a trace
    of this model takes), as a dict orjson writes (numpy arrays included). ``top``: how many
    tokens each sampling stage lists; ``attention``: whether to record the attention weights
    (``attention_encoding`` "lists" or "uint8"). The interventions (``position_offset``,
    ``ablate`` as (layer, head) pairs, ``drop_positional`` layers; checked in the API process)
    change that one forward, and every field is that of the changed pass; ``logit_lens`` adds
    each layer's ``lens_top`` most probable next tokens. ``score_parts`` (layer, head) and
    ``attribution`` (of ``target``, default the argmax) add ``server.engine.explain``'s."""
    model, vocab, names = served.model, served.vocab, served.token_strings
    device = next(model.parameters()).device
    ids = torch.tensor(prompt_ids, device=device)  # [T]
    positions = positions_table(len(prompt_ids), device) + position_offset  # [1, T]
    ablated = frozenset((layer, head) for layer, head in ablate)
    intervention = Intervention(position_offset, ablated, frozenset(drop_positional))
    with torch.inference_mode():
        recorder = AttentionRecorder(
            weights=attention,
            scores_of=None if score_parts is None else score_parts[0],
            outputs=attribution,
        )
        logits = model.traced_forward(ids.unsqueeze(0), recorder, intervention)
        logits = logits[0, :, :vocab].float()  # [T, V]
        token_vectors = model.token_embedding(ids).float()  # [T, d_model]
        position_vectors, rotation, bias = _scheme_pieces(model, positions, set(drop_positional))
        seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=device)
        seen[ids] = True
        constraint = constraint_of(params, served.tokenizer, served.eos)
        stages = sampling_stages(logits[-1], params, seen, constraint=constraint)
        logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[1:, None])[:, 0]
        vectors = None if position_vectors is None else position_vectors[0]  # [T, d]
        parts = None
        if score_parts is not None:
            layer, head = score_parts
            dropped = layer in drop_positional or layer in model.skipped_layers
            parts = explain.score_parts(model, recorder, layer, head, ids, vectors, dropped)
        attributed = None
        if attribution:
            chosen = int(logits[-1].argmax()) if target is None else target
            logit = float(logits[-1, chosen])
            attributed = explain.attribution(model, recorder, ids, vectors, logit, chosen, names)

    top = min(top, vocab)
    return {
        **_header(served, limit),
        "tokens": [{"id": token, "text": names[token]} for token in prompt_ids],
        "positions": positions[0].tolist(),
        "embedding": _embedding(token_vectors, position_vectors),
        # [L, H, T, T] (a batch of one)
        **_attention(recorder.weights if attention else None, attention_encoding),
        "position_bias": None if bias is None else _lower_triangle(bias[0].float()),
        **_layer_pieces(recorder),
        "rotation": None
        if rotation is None
        else _angles(rotation, model.positional.key_width_factor),
        "next_token": {
            "greedy": params.greedy,
            "stages": [_stage(stage.name, stage.probs, top, names) for stage in stages],
        },
        "surprisal": [None, *(-logprobs.cpu() / math.log(2)).tolist()],
        "logit_lens": _lens(model, recorder.residuals, vocab, names, lens_top)
        if logit_lens
        else None,
        "score_parts": parts,
        "attribution": attributed,
    }


def _header(served: LoadedModel, limit: int) -> dict[str, Any]:
    """A trace's first fields: what it is, and the model's."""
    config = served.model.config
    return {
        "object": "trace",
        "model": served.name,
        "scheme": config.scheme,
        "context_length": config.context_length,
        "limit": limit,
        "n_layers": config.n_layers,
        "n_heads": config.n_heads,
    }


def _embedding(token_vectors: Tensor, position_vectors: Tensor | None) -> dict[str, Any]:
    """The norms of the tokens' vectors [T, d] and of the scheme's added vectors [1, T, d]
    (None without them), and those vectors."""
    vectors = None if position_vectors is None else position_vectors[0].float()
    return {
        "token_norm": _array(token_vectors.norm(dim=-1)),
        "position_norm": None if vectors is None else _array(vectors.norm(dim=-1)),
        "position_vectors": None if vectors is None else _rounded(vectors),
    }


def _scheme_pieces(
    model: Transformer, positions: Tensor, dropped: set[int]
) -> tuple[Tensor | None, Rotation | None, Tensor | None]:
    """The scheme's pieces as the changed pass used them, for ``positions`` [1, T]: its added
    vectors [1, T, d] (entering before layer 0), its rotation (cos, sin) [1, 1, T, rot] and its
    bias [1, H, T, T], each None where the scheme has none or every layer drops it."""
    scheme = model.positional
    every_layer_dropped = dropped >= set(range(model.config.n_layers))
    vectors = None if 0 in dropped else scheme.embedding(positions)
    rotation = None if every_layer_dropped else scheme.rotation(positions)
    bias = None if every_layer_dropped else scheme.attention_bias(positions, positions[0])
    return vectors, rotation, bias


def _attention(weights: list[Tensor] | None, encoding: str) -> dict[str, Any]:
    """The attention fields: each layer's weights [1, H, T, T] as rounded lists or as uint8."""
    if weights is None:
        return {"attention": None, "attention_uint8": None}
    stacked = torch.cat(weights)  # [L, H, T, T] (a batch of one)
    if encoding == "lists":
        return {"attention": _lower_triangle(stacked), "attention_uint8": None}
    length = stacked.shape[-1]
    rows, keys = torch.tril_indices(length, length)  # row-major: query q's keys 0..q in turn
    levels = (stacked[..., rows, keys] * 255).round().to(torch.uint8)  # [L, H, T(T+1)/2]
    return {
        "attention": None,
        "attention_uint8": base64.b64encode(levels.cpu().numpy().tobytes()).decode(),
    }


def _lens(
    model: Transformer, residuals: list[Tensor], vocab: int, names: list[str], top: int
) -> dict[str, Any]:
    """Each block's output [1, T, d] through the final norm and the unembedding: per layer and
    position the ``top`` most probable tokens (the last layer's are the served ones)."""
    with torch.inference_mode():
        logits = model.unembed(torch.cat(residuals))[..., :vocab].float()  # [L, T, V]
        probs, ids = logits.softmax(dim=-1).topk(min(top, vocab), dim=-1)
    return {
        "ids": ids.cpu().numpy().astype(np.int32),
        "probs": _array(probs),
        "texts": [[[names[token] for token in row] for row in layer] for layer in ids.tolist()],
    }


def _layer_pieces(recorder: AttentionRecorder) -> dict[str, Any]:
    """layer_bias, forget_gates and contextual_positions from what each layer recorded (a batch
    of one): each None unless the scheme gives it."""
    layers = recorder.layer_biases
    biases = [layer.bias for layer in layers]
    gates = [layer.gates for layer in layers if layer.gates is not None]
    positions = [layer.positions for layer in layers if layer.positions is not None]
    return {
        "layer_bias": _lower_triangle(torch.cat(biases)) if biases else None,
        "forget_gates": _array(torch.cat(gates)) if gates else None,
        "contextual_positions": _lower_triangle(torch.cat(positions)) if positions else None,
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


def _angles(rotation: tuple[Tensor, Tensor], key_width_factor: int = 1) -> np.ndarray:
    """The rotation's angle per position and pair → [T, rot/2] radians (PoPE, whose keys are
    twice as wide: per component, [T, hd]).

    cos/sin [1, 1, T, rot] in the NeoX half-split layout (the pair i is columns i and
    i + rot/2; PoPE's column c is component c). atan2 gives each angle modulo 2π; unwrapping
    along positions recovers position × frequency, since no frequency turns by π or more in
    one position.
    """
    cos, sin = (part[0, 0].float().cpu() for part in rotation)
    half = cos.shape[-1] if key_width_factor == 2 else cos.shape[-1] // 2
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
