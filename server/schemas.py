"""Request bodies, validated strictly: a wrong type or an out-of-range value is a 400 naming the
field (``true`` is not a number, ``2.0`` is not an integer, ``"1"`` is not a float).

Limits that depend on the model (prompt length, room left for ``max_tokens``, token ids within
the vocabulary) are checked once the model is known, in ``server.completions``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_STOPS = 4
MAX_LOGPROBS = 5
DEFAULT_MAX_TOKENS = 16  # OpenAI's default; lowered to the room left when the context is short

TokenId = Annotated[int, Field(ge=0)]
Prompt = str | list[TokenId]


class StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(StrictBody):
    include_usage: bool = False


class CompletionRequest(StrictBody):
    """``POST /v1/completions``, as in OpenAI's legacy completions API."""

    model: str | None = None  # None: the server's default model
    prompt: Prompt
    echo: bool = False  # declared before max_tokens, whose check reads it
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    n: Literal[1] = 1  # accepted for client compatibility; one choice per request
    user: str | None = None
    # vLLM's extension: logprobs name tokens "token_id:<id>" instead of their text.
    return_tokens_as_token_ids: bool = False
    # vLLM's extension: keep generating past <|eos|> (benchmarks need exact lengths).
    ignore_eos: bool = False

    @field_validator("max_tokens")
    @classmethod
    def _zero_only_with_echo(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value == 0 and not info.data.get("echo"):
            raise ValueError("must be ≥ 1 (0 is allowed only with echo, to score the prompt)")
        return value

    @field_validator("stop")
    @classmethod
    def _few_non_empty_stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOPS or "" in stops:
            raise ValueError(f"must be at most {MAX_STOPS} non-empty strings")
        return stops

    @property
    def stops(self) -> list[str]:
        """``stop`` as a list (the validator has normalised it)."""
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TokenizeRequest(StrictBody):
    """``POST /v1/tokenize``: the ids a prompt becomes (with ``<|bos|>`` unless told not to)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
