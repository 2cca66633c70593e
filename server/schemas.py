"""Request bodies, validated strictly: a wrong type or an out-of-range value is a 400 naming the
field (``true`` is not a number, ``2.0`` is not an integer, ``"1"`` is not a float).

Every value that passes is one the sampler handles (``model.sampling`` says why each bound is
where it is): temperature in [0, 2], below 1e-5 greedy; repetition_penalty in [0.01, 100];
top_k any integer ≥ 0, one at or past the vocabulary's size meaning off (as 0 does). Every string
must be valid Unicode (a lone surrogate such as ``"\ud800"`` is a 400, not a tokenizer crash).

Limits that depend on the model (prompt length, room left for ``max_tokens``, token ids within
the vocabulary) are checked once the model is known, in ``server.completions``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from model.sampling import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, SamplingParams

MAX_STOPS = 4
MAX_LOGPROBS = 5
DEFAULT_MAX_TOKENS = 16  # OpenAI's default; lowered to the room left when the context is short


def _valid_unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"is not valid Unicode: a lone surrogate at character {error.start}"
        ) from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]  # every string field of a request
TokenId = Annotated[int, Field(ge=0)]
Prompt = Text | list[TokenId]


class StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(StrictBody):
    include_usage: bool = False


class PromptRequest(StrictBody):
    """A prompt for a model and the sampling settings its next token is drawn with: the fields
    completions and traces share, validated the same way."""

    model: Text | None = None  # None: the server's default model
    prompt: Prompt
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)  # at or past the vocabulary's size = off, like 0
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    repetition_penalty: float = Field(
        1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY, allow_inf_nan=False
    )

    def sampling_params(self, vocab: int, seed: int | None = None) -> SamplingParams:
        """These settings for a model of ``vocab`` tokens: a top_k that keeps the whole
        vocabulary is off, so it draws exactly as top_k 0 (and never overflows int64)."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k if self.top_k < vocab else 0,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=seed,
        )


class CompletionRequest(PromptRequest):
    """``POST /v1/completions``, as in OpenAI's legacy completions API."""

    echo: bool = False  # declared before max_tokens, whose check reads it
    max_tokens: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    n: Literal[1] = 1  # accepted for client compatibility; one choice per request
    user: Text | None = None
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


class ModelHealth(BaseModel):
    state: Literal["loading", "ready", "failed"]
    message: str | None = None  # why it failed


class HealthDocument(BaseModel):
    """``GET /health``: ok (every model ready), degraded (some), loading or failed (none)."""

    status: Literal["ok", "degraded", "loading", "failed"]
    models: dict[str, ModelHealth]


class TokenizeRequest(StrictBody):
    """``POST /v1/tokenize``: the ids a prompt becomes (with ``<|bos|>`` unless told not to)."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True


# A longer trace prompt is a 400 (context_length_exceeded): the response grows as T².
MAX_TRACE_TOKENS = 256
DEFAULT_TRACE_TOP = 20


class TraceRequest(PromptRequest):
    """``POST /v1/trace``: one forward pass over the prompt, and the next token's distribution
    through each sampling stage for these settings (validated exactly like completions).

    ``top``: how many of the most probable tokens each stage lists (capped at the vocabulary;
    the whole vocabulary lists every token).
    """

    top: int = Field(DEFAULT_TRACE_TOP, ge=1, le=2**16)
