"""Where an attention score and a logit come from, and what a residual stream carries: the
compute half of ``/v1/trace``'s ``score_parts`` and ``attribution`` and of ``POST /v1/patch``
(``server.api.explain`` documents the responses).

Each is read off one traced forward pass (``Transformer.traced_forward`` with an
:class:`~model.transformer.AttentionRecorder`), the pass the server's logits come from:

- **score parts**: the last query's pre-softmax scores against every key, split into the part
  that does not depend on position (content) and the rest (position), the split each kind of
  scheme allows. Rotation: the rotation removed gives the content, and each rotation pair's own
  dot product gives its share. Bias: the scheme's bias is the position part. Added vectors: at
  layer 0 the norm's scale is frozen from the run, which makes queries and keys linear in the
  token and position vectors, so the score is four exact dot products; deeper layers mix them.
- **attribution**: with the final norm's scale frozen from the run, the next-token logit is a
  sum over what the residual stream is a sum of: the token's embedding, the added positional
  vector, each head's output through its slice of the output projection, each MLP's output.
- **patching**: the corrupted prompt run with one (stream, position) of its residual stream
  replaced by the clean run's, many such runs a batch.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from model.transformer import (
    AttentionRecorder,
    Block,
    Intervention,
    LayerScores,
    ResidualPatch,
    Transformer,
)

SEPARABLE_NOTE = {
    "rotation": "content is q·k of the unrotated query and key; position is what the rotation "
    "adds. Each rotation pair's share is listed under frequencies (fastest first).",
    "bias": "content is q·k/√d; position is the scheme's bias, added to every score.",
    "data-dependent": "content is q·k/√d; position is the bias this layer computed from its own "
    "inputs (fox's forget gates, cope's contextual positions, what PaTH's transitions of the "
    "tokens in between did to the key).",
    "added": "at layer 0 the norm's scale is taken from the run, so the score splits exactly into "
    "token·token (content) and token·position, position·token and position·position "
    "(position), listed under terms.",
    "none": "no positional signal reaches this layer's scores: the whole score is content.",
    "weights": "no position enters the score, so it is all content: stick-breaking reads the "
    "keys' order when it turns scores into weights (each key gets σ(score) of what the later "
    "keys left).",
}
POLAR_NOTE = (
    "content is Σ softplus(q)·softplus(k)/√d, the score at distance 0 with no phase bias; "
    "position is what the phases add. Each component's share is listed under frequencies "
    "(fastest first)."
)
MIXED_NOTE = (
    "past layer 0 the residual stream holds the positional vector mixed with what earlier "
    "layers computed from it and from the tokens, so no exact split exists: only the score is "
    "given. Choose layer 0 for the four terms."
)
ERASED_NOTE = (
    "Here every position term is 0: the vector is the same in every dimension, and the norm "
    "subtracts each vector's mean, so the position never reaches the attention."
)
UNSPLIT_QK_NORM = (
    "this model normalises queries and keys per head, which is not linear in the token and "
    "position vectors: only the score is given."
)


def score_parts(
    model: Transformer,
    recorder: AttentionRecorder,
    layer: int,
    head: int,
    tokens: Tensor,
    position_vectors: Tensor | None,
    dropped: bool,
) -> dict[str, Any]:
    """The last query's scores against each key in ``layer``'s ``head``, split: see the module
    docstring and ``server.api.explain.ScoreParts``. ``tokens`` [T]; ``position_vectors``
    [T, d_model], the added vectors the pass used (None: none were added); ``dropped``: the
    layer ran without the scheme's signal (an intervention)."""
    scores = recorder.scores
    assert scores is not None, "the recorder was asked for this layer's scores"
    query, keys, unrotated = _head_vectors(scores, head)
    scale = 1 / math.sqrt(query.shape[-1])
    dot = keys @ query * scale  # [T]
    bias = _score_bias(scores, head)
    score = dot + bias
    kind = "none" if dropped else model.positional.kind
    length = score.shape[0]
    parts: dict[str, Any] = {
        "layer": layer,
        "head": head,
        "query": length - 1,
        "kind": kind,
        "distance": list(range(length - 1, -1, -1)),
        "score": _floats(score),
        "content": None,
        "position": None,
        "frequencies": None,
        "frequency": None,
        "terms": None,
        "note": SEPARABLE_NOTE[kind],
    }
    if kind == "rotation":
        assert unrotated is not None
        content = _unturned(model, *unrotated)
        shares, frequency = _pair_shares(model, query, keys, scale)
        if model.positional.key_width_factor == 2:  # PoPE: magnitudes, not raw components
            parts["note"] = POLAR_NOTE
        parts |= {"frequencies": [_floats(share) for share in shares], "frequency": frequency}
    elif kind in ("bias", "data-dependent"):  # the bias itself, not score − content's rounding
        return parts | {"content": _floats(dot), "position": _floats(bias)}
    elif kind == "added":
        if layer != 0 or position_vectors is None:
            return parts | {"note": MIXED_NOTE}
        if model.config.qk_norm:
            return parts | {"note": UNSPLIT_QK_NORM}
        terms = _added_terms(model, recorder, head, tokens, position_vectors, scale)
        parts["terms"] = {name: _floats(term) for name, term in terms.items()}
        content = terms["token_token"]
        if not terms["position_position"].any():
            parts["note"] += " " + ERASED_NOTE
    else:  # none, weights
        content = score
    return parts | {"content": _floats(content), "position": _floats(score - content)}


def _head_vectors(
    scores: LayerScores, head: int
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """The last query [hd] of ``head`` (a batch of one), the keys [T, hd] it reads, and the
    same two before the rotation (None for a pass that records none)."""
    heads, kv_heads = scores.queries.shape[1], scores.keys.shape[1]
    key_head = head // (heads // kv_heads)
    query = scores.queries[0, head, -1].float()
    keys = scores.keys[0, key_head].float()
    if scores.unrotated is None:
        return query, keys, None
    raw = scores.unrotated[0].float()  # [H + Hkv, T, hd]
    return query, keys, (raw[head, -1], raw[heads + key_head])


def _score_bias(scores: LayerScores, head: int) -> Tensor:
    """What the mask added to the last query's scores [T] (0 where it only masks)."""
    mask = scores.mask.mask
    length = scores.keys.shape[2]
    if mask is None or mask.dtype == torch.bool:
        return torch.zeros(length, device=scores.keys.device)
    row = mask[0, head if mask.shape[1] > 1 else 0, -1].float()  # [T]; the last query sees all
    return row


def _unturned(model: Transformer, raw_query: Tensor, raw_keys: Tensor) -> Tensor:
    """The last query's score against each key [T] with no turn: q·k/√d of the vectors before
    the rotation; for PoPE (keys twice as wide) Σ softplus(q)·softplus(k)/√d, its score at
    distance 0 with no phase bias."""
    scale = 1 / math.sqrt(raw_query.shape[-1])
    if model.positional.key_width_factor == 2:
        magnitude = torch.nn.functional.softplus
        return magnitude(raw_keys) @ magnitude(raw_query) * scale
    return raw_keys @ raw_query * scale


def _pair_shares(
    model: Transformer, query: Tensor, keys: Tensor, scale: float
) -> tuple[list[Tensor], list[float]]:
    """Each rotation pair's share of the rotated q·k/√d [T], and its angle per position.

    The NeoX layout pairs dimension i with i + rot/2; dimensions past ``rot`` (p-RoPE's) are
    never rotated, and are listed last as pairs of frequency 0, paired the same way. PoPE's
    turned vectors hold each component's cos part then its sin part: component c is the pair
    (c, c + d)."""
    head_dim = query.shape[-1]
    rotary = model.positional.rotation(torch.arange(2, device=query.device).unsqueeze(0))
    assert rotary is not None, "a rotation scheme rotates"
    cos, sin = (part.reshape(2, -1)[1].float() for part in rotary)
    half = cos.shape[-1] if model.positional.key_width_factor == 2 else cos.shape[-1] // 2
    frequency = torch.atan2(sin[:half], cos[:half]).tolist()  # one position's turn, < π
    products = keys * query  # [T, hd]
    pairs = [(i, i + half) for i in range(half)]
    rest = head_dim - 2 * half
    pairs += [(2 * half + i, 2 * half + i + rest // 2) for i in range(rest // 2)]
    if rest % 2:
        pairs.append((head_dim - 1, head_dim - 1))  # an odd dimension out: a pair of one
    shares = [(products[:, a] + (products[:, b] if b != a else 0)) * scale for a, b in pairs]
    return shares, frequency + [0.0] * (len(pairs) - half)


def frozen_norm(norm: nn.Module, x: Tensor) -> tuple[Callable[[Tensor], Tensor], Tensor]:
    """``norm`` (LayerNorm or RMSNorm) at ``x`` [..., d] as a linear map plus a constant: the
    scale each position divides by is taken from ``x``, so that for any parts summing to x,
    ``norm(x) = Σ linear(part) + constant`` (the constant [d]: LayerNorm's bias, or zeros)."""
    gain = cast(Tensor, norm.weight).float()
    if isinstance(norm, nn.LayerNorm):
        scale = torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + norm.eps)
        shift = torch.zeros_like(gain) if norm.bias is None else norm.bias.float()
        return (lambda part: (part - part.mean(-1, keepdim=True)) / scale * gain), shift
    assert isinstance(norm, nn.RMSNorm)
    eps = torch.finfo(x.dtype).eps if norm.eps is None else norm.eps
    scale = torch.sqrt(x.square().mean(-1, keepdim=True) + eps)
    return (lambda part: part / scale * gain), torch.zeros_like(gain)


def _added_terms(
    model: Transformer,
    recorder: AttentionRecorder,
    head: int,
    tokens: Tensor,
    position_vectors: Tensor,
    scale: float,
) -> dict[str, Tensor]:
    """Layer 0's scores of the last query [T] as four dot products: the query and the keys each
    split into the token's part and the position vector's part, through layer 0's norm (its
    scale frozen from the run; its constant and the projection's bias go with the token)."""
    assert recorder.embedded is not None
    block = _blocks(model)[0]
    linear, shift = frozen_norm(block.attention_norm, recorder.embedded[0].float())
    weight = block.attention.qkv.weight.float()  # [(H + 2·Hkv)·hd, d]
    bias = block.attention.qkv.bias
    token_part = linear(model.token_embedding(tokens).float()) + shift  # [T, d]
    position_part = linear(position_vectors.float())  # [T, d]
    heads, head_dim = model.config.n_heads, model.config.head_dim
    key_head = heads + head // (heads // model.config.key_value_heads)
    rows = {"query": slice(head * head_dim, (head + 1) * head_dim)}
    rows["key"] = slice(key_head * head_dim, (key_head + 1) * head_dim)

    def project(part: Tensor, which: str, with_bias: bool) -> Tensor:
        out = part @ weight[rows[which]].T
        return out + bias[rows[which]].float() if with_bias and bias is not None else out

    query = {"token": project(token_part, "query", True)[-1]}
    query["position"] = project(position_part, "query", False)[-1]
    keys = {
        "token": project(token_part, "key", True),
        "position": project(position_part, "key", False),
    }
    return {
        f"{q}_{k}": keys[k] @ query[q] * scale
        for q in ("token", "position")
        for k in ("token", "position")
    }


def attribution(
    model: Transformer,
    recorder: AttentionRecorder,
    tokens: Tensor,
    position_vectors: Tensor | None,
    logit: float,
    target: int,
    names: Sequence[str],
) -> dict[str, Any]:
    """The last position's logit of ``target`` as a sum of parts (``server.api.explain``):
    ``recorder`` kept every head's and MLP's output; ``tokens`` [T]; ``position_vectors``
    [T, d_model] or None; ``logit``: the served value the parts sum to."""
    final = recorder.residuals[-1][0, -1].float()  # [d]
    linear, shift = frozen_norm(model.final_norm, final)
    direction = model.lm_head.weight[target].float()  # [d]

    def value(part: Tensor) -> float:
        return float(linear(part) @ direction)

    parts = [_part("embedding", value(model.token_embedding(tokens[-1:])[0].float()))]
    if position_vectors is not None:
        parts.append(_part("position", value(position_vectors[-1].float())))
    constant = shift @ direction
    head_dim = model.config.head_dim
    for layer, block in enumerate(_blocks(model)):
        heads = recorder.head_outputs[layer][0, :, -1].float()  # [H, hd]
        projection = block.attention.proj.weight.float()  # [d, H·hd]
        for head in range(heads.shape[0]):
            slice_ = projection[:, head * head_dim : (head + 1) * head_dim]
            parts.append(_part(f"L{layer}.H{head}", value(slice_ @ heads[head]), layer, head))
        if block.attention.proj.bias is not None:
            constant = constant + linear(block.attention.proj.bias.float()) @ direction
        parts.append(_part(f"L{layer}.mlp", value(recorder.mlp_outputs[layer][0, -1]), layer))
    if model.config.bias:
        parts.append(_part("bias", float(constant)))
    return {
        "token": {"id": target, "text": names[target]},
        "logit": logit,
        "parts": parts,
    }


def _blocks(model: Transformer) -> list[Block]:
    return cast(list[Block], list(model.blocks))


def _part(name: str, value: float, layer: int | None = None, head: int | None = None) -> dict:
    return {"name": name, "layer": layer, "head": head, "value": value}


def patch_effects(
    model: Transformer,
    vocab: int,
    clean: list[int],
    corrupted: list[int],
    target: int | None,
    sites: Sequence[tuple[int, int]],
) -> dict[str, Any]:
    """Activation patching of ``sites`` ((stream, position) pairs; stream 0 enters layer 0,
    stream s + 1 leaves layer s): for each, the corrupted prompt's run with that stream at that
    position replaced by the clean run's, and how much of the target's clean − corrupted logit
    difference at the last position it brings back. ``target`` None: clean's argmax. One
    batched pass for both prompts, one for every site."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits, streams = _baseline(model, clean, corrupted)  # [2, V]; [L + 1, T, d]
        chosen = int(logits[0, :vocab].argmax()) if target is None else target
        clean_logit, corrupted_logit = logits[:, chosen].tolist()
        effect: list[float] = []
        if sites:
            at = torch.tensor(sites, device=device)  # [N, 2]
            patch = ResidualPatch(at[:, 0], at[:, 1], streams[at[:, 0], at[:, 1]])
            rows = torch.tensor([corrupted], device=device).expand(len(sites), -1)  # [N, T]
            patched = model.traced_forward(rows, None, Intervention(patch=patch), last_only=True)
            recovered = patched[:, chosen].float() - corrupted_logit
            effect = (recovered / (clean_logit - corrupted_logit)).tolist()
    return {
        "target": chosen,
        "clean_logit": clean_logit,
        "corrupted_logit": corrupted_logit,
        "effect": effect,
    }


# A patch arrives in several calls of the same two prompts: their runs are kept between them.
_BASELINES: OrderedDict[tuple[int, tuple[int, ...], tuple[int, ...]], tuple[Tensor, Tensor]] = (
    OrderedDict()
)
KEPT_BASELINES = 8  # patches of one model in the engine at once: --max-traces, 4 by default


def _baseline(model: Transformer, clean: list[int], corrupted: list[int]) -> tuple[Tensor, Tensor]:
    """The two prompts' last logits [2, vocab] and the clean run's residual streams
    [L + 1, T, d_model] (the embeddings, then each layer's output), from one batched pass."""
    key = (id(model), tuple(clean), tuple(corrupted))
    if key in _BASELINES:
        _BASELINES.move_to_end(key)
        return _BASELINES[key]
    recorder = AttentionRecorder(weights=False)
    both = torch.tensor([clean, corrupted], device=next(model.parameters()).device)
    logits = model.traced_forward(both, recorder, last_only=True).float()
    assert recorder.embedded is not None
    streams = torch.stack([recorder.embedded[0], *(r[0] for r in recorder.residuals)])
    _BASELINES[key] = (logits, streams)
    while len(_BASELINES) > KEPT_BASELINES:
        _BASELINES.popitem(last=False)
    return logits, streams


def _floats(tensor: Tensor) -> list[float | None]:
    """[T] → a list, None where the scheme masks the key (irope's window: −inf)."""
    values = tensor.detach().float().cpu()
    return [value if math.isfinite(value) else None for value in values.tolist()]
