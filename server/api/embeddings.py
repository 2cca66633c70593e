"""``POST /v1/embeddings``: OpenAI's request and response, computed by the engine.

Each input (a text, with ``<|bos|>`` first as a completion's prompt gets it, or token ids used
as given) runs one uncached forward pass of the served model, alone, in the engine process
(``server.engine.calls.embed``, between two decode steps, as a trace does); its vector is a
hidden state pooled over the input's positions. The hidden states are a research object here,
so ordinal adds two fields:

- ``layer``: which residual stream. None (the default): the final norm's output, the state the
  logits are read from. ``0``: the embeddings entering the first block (tokens plus an additive
  scheme's position vectors); ``k`` (1 … n_layers): block k's output.
- ``pooling``: ``mean`` over every position (the default; a text's ``<|bos|>`` included), or
  ``last``, the last position's state (the one that predicts the next token).

Vectors are not normalised: they are the model's own numbers, float32 (``encoding_format``
``base64``: the little-endian float32 bytes, as OpenAI sends them; its SDK asks for that by
default and decodes it). This module, in the API process, checks the request and tokenises it;
the engine writes the response.
"""

from __future__ import annotations

from typing import Annotated, Literal, cast

from pydantic import Field

from server.api.completions import prompt_ids_of
from server.api.errors import APIError, too_long
from server.api.schemas import (
    Prompt,
    StrictBody,
    Text,
    TokenId,
    Unsupported,
    refused_unless,
)
from server.api.service import ServedModel

MAX_INPUTS = 256
# The most tokens one request computes: the engine's decode loop waits for the whole call.
MAX_TOKENS = 8192


class EmbeddingRequest(StrictBody):
    """``POST /v1/embeddings``, as in OpenAI's API, with ordinal's ``layer`` and ``pooling``."""

    model: Text | None = None  # None: the server's default model
    # OpenAI's four forms: a text, token ids, or a list of either (one vector each)
    input: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[list[TokenId]], Field(min_length=1, max_length=MAX_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    user: Text | None = None  # informs OpenAI's own service
    dimensions: Annotated[Unsupported, refused_unless()] = None
    layer: int | None = Field(
        None,
        ge=0,
        description="the residual stream: null = the final norm's output (the default), 0 = "
        "the embeddings entering block 0, k = block k's output (1..n_layers)",
    )
    pooling: Literal["mean", "last"] = Field(
        "mean", description="mean over every position, or the last position's state"
    )

    @property
    def inputs(self) -> dict[str, Prompt]:
        """Each input of ``input`` (one text or one list of token ids) by its field's name:
        ``input``, or ``input[i]`` when it is a list of them."""
        given = self.input
        if isinstance(given, str) or isinstance(given[0], int):
            return {"input": cast(Prompt, given)}  # the checker cannot narrow by the first
        return {f"input[{index}]": cast(Prompt, one) for index, one in enumerate(given)}


async def create_embeddings(body: EmbeddingRequest, served: ServedModel) -> tuple[bytes, int]:
    """The JSON of OpenAI's embeddings response for ``body``, and the tokens it computed (a 400
    naming the field for a layer the model lacks, an id outside its vocabulary, or an input or
    request too long)."""
    layers = served.info.n_layers
    if body.layer is not None and body.layer > layers:
        raise APIError(
            400,
            f"layer is {body.layer}, but model '{served.name}' has {layers} blocks: 0 (the "
            f"embeddings) to {layers} (the last block's output)",
            param="layer",
        )
    ids = []
    for field, given in body.inputs.items():
        ids.append(await prompt_ids_of(given, served, field))
        if len(ids[-1]) > served.max_context:
            raise too_long(
                field, len(ids[-1]), f"model '{served.name}'", served.max_context, "input"
            )
    total = sum(map(len, ids))
    if total > MAX_TOKENS:
        raise APIError(
            400,
            f"input: the inputs are {total} tokens in all; at most {MAX_TOKENS} per request "
            "(send them in several requests)",
            param="input",
            code="context_length_exceeded",
        )
    args = {
        "inputs": ids,
        "layer": body.layer,
        "pooling": body.pooling,
        "encoding_format": body.encoding_format,
    }
    return await served.engine.call("embed", args), total
