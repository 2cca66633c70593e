"""Where an attention decision and a next token come from: ``/v1/trace``'s ``score_parts`` and
``attribution`` (documented here, computed with the trace), and ``POST /v1/patch``.

The computing is in the engine process (``server.engine.explain``); this module checks the
requests and documents the responses. A patch runs the corrupted prompt once for each
(stream, position) whose stream differs from the clean run's, in engine calls of at most
:data:`PATCH_TOKENS_PER_CALL` tokens, one a turn of the engine's loop, so that streams decode
between them; the whole patch is admitted once, as one trace is (``--max-traces``). The rest
need no run: a position before the first token that differs carries the same residual stream
in both prompts (every scheme is causal), and so does the embedding of a token both share, so
their effect is 0.
"""

from __future__ import annotations

import orjson
from pydantic import BaseModel, Field

from server.api.completions import prompt_ids_of
from server.api.errors import APIError, too_long
from server.api.schemas import MAX_PATCH_TOKENS, PatchRequest
from server.api.service import ServedModel

# Tokens one engine call of a patch runs (a row of the corrupted prompt per site): about what
# a trace of 128 tokens costs, so that a stream waits no longer between two steps. The two
# prompts' own runs are made once per patch (the engine keeps them between its calls).
PATCH_TOKENS_PER_CALL = 512
# A smaller clean − corrupted logit difference leaves every effect mostly rounding error.
MIN_DIFFERENCE = 1e-3

# ---- the responses, as documented in the OpenAPI spec --------------------------------------


class ScoreParts(BaseModel):
    """One head's scores of the last query (``query``) against every key, split in two."""

    layer: int
    head: int
    query: int = Field(description="the query's index: the prompt's last token")
    kind: str = Field(
        description="the split used: rotation, bias, data-dependent, added or none (the "
        "scheme's kind; none also for a layer in drop_positional)"
    )
    distance: list[int] = Field(description="[T] query − key for keys 0..T-1")
    score: list[float | None] = Field(
        description="[T] the pre-softmax score: q·k/√d plus any bias; null for a key the scheme "
        "masks (irope's window)"
    )
    content: list[float | None] | None = Field(
        description="[T] the part that does not depend on position; null where no exact split "
        "exists (note says why)"
    )
    position: list[float | None] | None = Field(
        description="[T] the rest: content + position = score (null where score is)"
    )
    frequencies: list[list[float | None]] | None = Field(
        description="[pairs][T] rotation: each rotation pair's share of the score (they sum to "
        "it), fastest first; dimensions never rotated (p-RoPE's) come last as frequency 0"
    )
    frequency: list[float] | None = Field(
        description="[pairs] rotation: each pair's angle per position, in radians"
    )
    terms: dict[str, list[float | None]] | None = Field(
        description="added vectors, layer 0: token_token, token_position, position_token and "
        "position_position [T] (query part then key part), summing to the score"
    )
    note: str = Field(description="what the split is for this scheme and layer")


class AttributionPart(BaseModel):
    name: str = Field(
        description="embedding, position (an added vector), L{layer}.H{head}, L{layer}.mlp, or "
        "bias (models with biases)"
    )
    layer: int | None
    head: int | None
    value: float = Field(description="its share of the logit")


class AttributionToken(BaseModel):
    id: int
    text: str


class Attribution(BaseModel):
    """The last position's logit of ``token`` as a sum over what the residual stream sums, with
    the final norm's scale taken from the run."""

    token: AttributionToken
    logit: float = Field(description="the served logit; the parts sum to it")
    parts: list[AttributionPart]


class PatchToken(BaseModel):
    id: int
    text: str


class PatchResponse(BaseModel):
    """Activation patching: how much of the target's logit each residual stream carries."""

    object: str = "patch"
    model: str
    scheme: str
    n_layers: int
    clean_tokens: list[PatchToken]
    corrupted_tokens: list[PatchToken]
    target: PatchToken = Field(description="the token whose logit is measured")
    clean_logit: float = Field(description="the target's logit at the last position, clean")
    corrupted_logit: float = Field(description="the same, corrupted")
    streams: list[str] = Field(
        description="[layers + 1] embedding (entering layer 0), then each layer's output"
    )
    effect: list[list[float]] = Field(
        description="[layers + 1][T]: the corrupted run with that stream at that position "
        "replaced by the clean run's, (patched − corrupted) / (clean − corrupted) of the "
        "target's logit: 1 brings all of it back, 0 none"
    )


# ---- computing a patch ----------------------------------------------------------------------


async def create_patch(body: PatchRequest, served: ServedModel) -> bytes:
    """The JSON of :class:`PatchResponse` for ``body``: 400s for prompts too long or of two
    lengths, or a target outside the vocabulary; 429 while the model's traces are busy."""
    clean = await _prompt(body, served, "clean")
    corrupted = await _prompt(body, served, "corrupted")
    if len(clean) != len(corrupted):
        raise APIError(
            400,
            f"clean is {len(clean)} tokens and corrupted is {len(corrupted)} (counting "
            "<|bos|>): patching replaces a position of one run by the same position of the "
            "other, so the two prompts must tokenise to the same length",
            param="corrupted",
        )
    if clean == corrupted:
        raise APIError(
            400,
            "corrupted is the same tokens as clean: patching needs prompts that differ",
            param="corrupted",
        )
    check_target(body.target, served)
    n_layers = served.info.n_layers
    sites = changed_sites(clean, corrupted, n_layers)
    per_call = max(1, PATCH_TOKENS_PER_CALL // len(clean))
    shares = [sites[i : i + per_call] for i in range(0, len(sites), per_call)] or [[]]
    args = {"clean": clean, "corrupted": corrupted, "target": body.target}
    answers = [
        orjson.loads(answer)
        for answer in await served.engine.calls("patch", [args | {"sites": s} for s in shares])
    ]
    effect = [[0.0] * len(clean) for _ in range(n_layers + 1)]
    for share, answer in zip(shares, answers, strict=True):
        for (stream, position), value in zip(share, answer["effect"], strict=True):
            effect[stream][position] = value
    first = answers[0]
    difference = first["clean_logit"] - first["corrupted_logit"]
    if abs(difference) < MIN_DIFFERENCE:
        raise APIError(
            400,
            f"the target's logit is {first['clean_logit']:.4f} clean and "
            f"{first['corrupted_logit']:.4f} corrupted: with no difference there is nothing to "
            "restore (choose a target, or prompts, that differ in what comes next)",
            param="target",
        )
    names = served.token_strings
    return orjson.dumps(
        {
            "object": "patch",
            "model": served.name,
            "scheme": served.info.scheme,
            "n_layers": n_layers,
            "clean_tokens": [{"id": token, "text": names[token]} for token in clean],
            "corrupted_tokens": [{"id": token, "text": names[token]} for token in corrupted],
            "target": {"id": first["target"], "text": names[first["target"]]},
            "clean_logit": first["clean_logit"],
            "corrupted_logit": first["corrupted_logit"],
            "streams": ["embedding", *(f"layer {layer}" for layer in range(n_layers))],
            "effect": effect,
        }
    )


def check_target(target: int | None, served: ServedModel) -> None:
    """A 400 naming ``target`` for a token id outside the model's vocabulary."""
    if target is not None and target >= served.vocab:
        raise APIError(
            400,
            f"target is {target}, outside model '{served.name}''s vocabulary [0, {served.vocab})",
            param="target",
        )


async def _prompt(body: PatchRequest, served: ServedModel, field: str) -> list[int]:
    """The token ids of ``field`` (clean or corrupted), at most MAX_PATCH_TOKENS."""
    ids = await prompt_ids_of(getattr(body, field), served, field)
    limit = min(MAX_PATCH_TOKENS, served.max_context)
    if len(ids) > limit:
        raise too_long(field, len(ids), f"a patch of model '{served.name}'", limit, field)
    return ids


def changed_sites(clean: list[int], corrupted: list[int], n_layers: int) -> list[tuple[int, int]]:
    """The (stream, position) pairs whose residual stream differs between the two prompts:
    stream 0 (the embeddings) where the tokens differ, every later stream from the first
    position that differs on (a causal model's stream at p reads positions 0..p only)."""
    differ = [p for p, (a, b) in enumerate(zip(clean, corrupted, strict=True)) if a != b]
    if not differ:
        return []
    later = range(differ[0], len(clean))
    return [(0, p) for p in differ] + [(s, p) for s in range(1, n_layers + 1) for p in later]
