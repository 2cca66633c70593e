"""Service settings: a flag of ``ordinal serve`` beats an ``ORDINAL_*`` variable beats the default.

Every field is both a flag (``--max-batch-size 8``) and an environment variable
(``ORDINAL_MAX_BATCH_SIZE=8``); list fields take comma-separated values in either place
(``ORDINAL_MODELS=rope,alibi``). Keep the API key in the environment: flags show up in ``ps``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from model.device import Device, Dtype
from server.messages import parse_rope_variant

CommaList = Annotated[list[str], NoDecode]  # NoDecode: parsed by _split_commas, not as JSON
SecretList = Annotated[list[SecretStr], NoDecode]


class Settings(BaseSettings):
    """Everything ``create_app`` needs. Invalid values raise pydantic's ValidationError
    (a ValueError) naming the field."""

    model_config = SettingsConfigDict(env_prefix="ORDINAL_", extra="forbid")

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    checkpoints: Path = Field(Path("checkpoints"), description="folder of checkpoint folders")
    models: CommaList = Field(
        default_factory=list,
        description="models to load, by folder name (default: every checkpoint in the folder)",
    )
    default_model: str | None = Field(
        None, description="model used when a request names none (default: rope, else the first)"
    )
    device: Device = Field("auto", description="auto = cuda if present")
    dtype: Dtype = Field("float32", description="dtype the models run in")
    threads: int = Field(
        1,
        ge=1,
        description=(
            "torch CPU threads of the engine's decode loop (default 1: on two cores the second "
            "thread contends with the API process and the clients; measured with 2 over HTTP: "
            "one stream 0.9x, 32 streams 1.03x, 64 streams 0.8x the tokens/s of 1)"
        ),
    )
    max_batch_size: int = Field(
        64,
        ge=1,
        description=(
            "sequences decoded together per model (its cache grows with the rows in use, and "
            "shrinks back when the model is idle)"
        ),
    )
    stream_interval: float = Field(
        0.02,
        ge=0,
        description=(
            "seconds a streamed token may wait to be sent with later ones, saving the decode "
            "thread a wake-up of the HTTP loop per token; tokens sent together reach the client "
            "as one event (one a token with logprobs); first and last tokens never wait "
            "(0 = send every step's tokens at once)"
        ),
    )
    prefill_chunk: int = Field(
        2048,
        ge=1,
        description=(
            "tokens per decode step, shared as vLLM's max_num_batched_tokens: each decoding "
            "stream takes one, prompt tokens of joining requests the rest, so a burst of "
            "prompts joins in one step; a longer prompt is prefilled over several steps, the "
            "streams already decoding taking a step between its chunks"
        ),
    )
    prefix_cache_tokens: int = Field(
        8192,
        ge=0,
        description=(
            "prompt tokens whose keys and values each model keeps, in blocks of 16, so that a "
            "prompt beginning with a recent one's tokens prefills only the rest (automatic "
            "prefix caching; least recently used blocks make room; 0 turns it off)"
        ),
    )
    cuda_graphs: bool = Field(
        True,
        description=(
            "on a GPU, replay decode steps from CUDA graphs recorded once per batch size and "
            "cache length (3.5-7.8x faster on an H200; no effect on a CPU)"
        ),
    )
    attention_helper: bool = Field(
        True,
        description=(
            "on a CPU, a second thread takes rows of each large decode step's attention (8 rows "
            "or more on one engine thread) while a core is free; the step never waits for it, "
            "and no number changes (two cores: 32 streams 1.09x the tokens/s)"
        ),
    )
    max_queue: int = Field(
        64, ge=0, description="requests that may wait for a free batch row, per model"
    )
    priority_aging: float = Field(
        1.0,
        ge=0,
        description=(
            "seconds of waiting that improve a queued request's priority by one, so that "
            "requests of a lower priority (more urgent, vLLM's polarity) hold it back for a "
            "bounded time: a priority 0 request goes before every -1 that arrives this long "
            "after it (0 = vLLM's strict order, where a stream of -1s holds a 0 back forever)"
        ),
    )
    speculative: Literal["off", "ngram"] = Field(
        "off",
        description=(
            "ngram: exact speculative decoding by prompt lookup (vLLM's method): a stream whose "
            "last tokens occurred earlier proposes the tokens that followed them there, and one "
            "step verifies them; the output is the same token for token, greedy or seeded. "
            "Models that cannot verify exactly (not on the CPU decode kernel, rope's dynamic "
            "scaling) say so in the log and /v1/models and decode one token a step"
        ),
    )
    num_speculative_tokens: int = Field(
        3, ge=1, le=16, description="the most draft tokens a stream verifies in one step"
    )
    prompt_lookup_max: int = Field(
        4, ge=1, le=16, description="the longest n-gram a speculative draft is looked up by"
    )
    prompt_lookup_min: int = Field(
        2, ge=1, le=16, description="the shortest n-gram a speculative draft is looked up by"
    )
    max_priority: int | None = Field(
        None,
        ge=-(2**31),
        lt=2**31,
        description=(
            "the most urgent priority (the lowest number) a request may claim without one of "
            "priority_keys; a lower one is a 403 naming priority (default: any, as vLLM)"
        ),
    )
    priority_keys: SecretList = Field(
        default_factory=list,
        description=(
            "API keys that may claim their own range of priorities, each KEY:LOWEST (e.g. "
            "ops-key:-10): 'Authorization: Bearer KEY' may claim LOWEST and above, in place of "
            "max_priority; each is also accepted where api_key is required (prefer the env var)"
        ),
    )
    max_context: int | None = Field(
        None,
        ge=2,
        description=(
            "most tokens (prompt + completion) per sequence; default per model: max_positions "
            "for learned/mds/lowrank, 4 × context_length for the others; never more than a "
            "scheme's table of positions"
        ),
    )
    request_timeout: float = Field(
        300.0, gt=0, description="seconds a request may take, queueing included"
    )
    api_key: SecretStr | None = Field(
        None,
        description=(
            "require 'Authorization: Bearer KEY' on the routes of auth_scope (prefer the env "
            "var; empty or blank is an error, unset means no key)"
        ),
    )
    auth_scope: Literal["api", "all"] = Field(
        "api",
        description=(
            "what the API key protects: api = /v1/*; all = every route but /health and the "
            "playground's page and static files (also /metrics, /docs, /openapi.json; the page "
            "asks for the key)"
        ),
    )
    rope_variants: CommaList = Field(
        default_factory=list,
        description=(
            "context-extension variants of every rope model, served on the same weights as "
            "models NAME+VARIANT: SCALING+FACTOR with SCALING linear, ntk, dynamic or yarn, "
            "e.g. yarn4,ntk4 → rope+yarn4, rope+ntk4 (default: none)"
        ),
    )
    cors_origins: CommaList = Field(
        default_factory=list, description="origins allowed by CORS (default: none)"
    )
    max_body_bytes: int = Field(1_000_000, ge=1, description="largest request body accepted")
    allowed_hosts: CommaList = Field(
        default_factory=list,
        description=(
            "Host header names served, e.g. ordinal.example,localhost (a foreign Host gets a "
            "400: DNS rebinding); default: on a loopback connection only localhost, 127.0.0.1 "
            "and ::1, any name otherwise"
        ),
    )
    keep_alive_timeout: float = Field(
        5.0, gt=0, description="seconds an idle keep-alive connection is kept open"
    )
    header_timeout: float = Field(
        10.0, gt=0, description="seconds a connection may take to send its request's headers"
    )
    max_connections: int | None = Field(
        None,
        ge=1,
        description=(
            "open connections at most; past it the longest-idle one is closed to make room "
            "(default: the open-file limit less 64, kept for the server's own files)"
        ),
    )
    max_traces: int = Field(
        4,
        ge=1,
        description=(
            "engine calls (POST /v1/trace, /v1/embeddings) running or queued per model; past it 429"
        ),
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description=(
            "export an OpenTelemetry span per POST request (vLLM's gen_ai.* attributes, the "
            "caller's traceparent continued) to this OTLP/HTTP collector URL, e.g. "
            "http://localhost:4318/v1/traces; needs the otel extra (default: off, nothing "
            "imported)"
        ),
    )
    watch_interval: float = Field(
        1.0,
        ge=0,
        description=(
            "seconds between looks at the checkpoints folder: a checkpoint folder that appears "
            "there is served once its files have not changed for one look, and one that fails "
            "to load (half-copied, corrupt) is reported in /health and tried again when its "
            "files change (0 = off; off with --models, which names what to serve)"
        ),
    )
    engine_stall_timeout: float = Field(
        10.0,
        gt=0,
        description=(
            "seconds the engine may go without a step while work waits; past it /health is "
            "503 and the engine process is restarted"
        ),
    )

    @field_validator("api_key")
    @classmethod
    def _key_not_blank(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError(
                "is empty or blank: set a real key, or unset ORDINAL_API_KEY to serve without one"
            )
        return value

    @field_validator("priority_keys")
    @classmethod
    def _keys_with_levels(cls, value: list[SecretStr]) -> list[SecretStr]:
        keys = [parse_priority_key(entry.get_secret_value()) for entry in value]
        if len({key for key, _ in keys}) < len(keys):
            raise ValueError("names one key twice")
        return value

    @field_validator("prompt_lookup_min")
    @classmethod
    def _lookup_within_max(cls, value: int, info: ValidationInfo) -> int:
        longest = info.data.get("prompt_lookup_max")
        if longest is not None and value > longest:
            raise ValueError(f"is above prompt_lookup_max ({longest})")
        return value

    @field_validator("rope_variants")
    @classmethod
    def _known_variants(cls, value: list[str]) -> list[str]:
        for variant in value:
            parse_rope_variant(variant)
        return value

    @field_validator(
        "models", "cors_origins", "rope_variants", "allowed_hosts", "priority_keys", mode="before"
    )
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value


def parse_priority_key(entry: str) -> tuple[str, int]:
    """``KEY:LOWEST`` → (KEY, LOWEST); a ValueError that never shows the key."""
    key, _, level = entry.rpartition(":")
    try:
        lowest = int(level)
    except ValueError:
        raise ValueError("each entry must be KEY:LOWEST, LOWEST an integer priority") from None
    if not key.strip():
        raise ValueError("an entry has an empty or blank key")
    if not -(2**31) <= lowest < 2**31:
        raise ValueError(f"a priority of {lowest} is outside [-2**31, 2**31)")
    return key, lowest
