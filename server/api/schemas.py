"""Request bodies, validated strictly: a wrong type or an out-of-range value is a 400 naming the
field (``true`` is not a number, ``2.0`` is not an integer, ``"1"`` is not a float).

Every value that passes is one the sampler handles (``model.sampling`` says why each bound is
where it is): temperature in [0, 2], below 1e-5 greedy; repetition_penalty in [0.01, 100];
top_k any integer ≥ 0, one at or past the vocabulary's size meaning off (as 0 does). Every string
must be valid Unicode (a lone surrogate such as ``"\ud800"`` is a 400, not a tokenizer crash).

Limits that depend on the model (prompt length, room left for ``max_tokens``, token ids within
the vocabulary) are checked once the model is known, in ``server.api.completions``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol, cast

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from model.grammar import Kind
from model.sampling_params import (
    MAX_OPENAI_PENALTY,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)
from server.api.errors import APIError

MAX_STOPS = 4
MAX_MESSAGES = 256
MAX_N = 8  # choices per prompt
MAX_CHOICES = 16  # choices per request: prompts × n
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
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
BiasedToken = Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]  # a token id, as OpenAI sends it
Bias = Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]
MAX_LOGIT_BIAS = 1024
Prompt = Text | list[TokenId]


class StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(StrictBody):
    """OpenAI's ``include_usage`` (a last chunk with the usage) and vLLM's
    ``continuous_usage_stats`` (with include_usage: the usage so far on every chunk too);
    null means false, as the clients that send them mean it."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


def _stop_list(value: str | list[str] | None) -> list[str]:
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > MAX_STOPS or "" in stops:
        raise ValueError(f"must be at most {MAX_STOPS} non-empty strings")
    return stops


Stops = Annotated[Text | list[Text] | None, AfterValidator(_stop_list)]  # normalised to a list


class SamplingRequest(StrictBody):
    """A model and the sampling settings its next tokens are drawn with: the fields every
    generating endpoint shares, validated the same way."""

    model: Text | None = None  # None: the server's default model
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)  # at or past the vocabulary's size = off, like 0
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    repetition_penalty: float = Field(
        1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY, allow_inf_nan=False
    )
    frequency_penalty: float = Field(
        0.0, ge=-MAX_OPENAI_PENALTY, le=MAX_OPENAI_PENALTY, allow_inf_nan=False
    )
    presence_penalty: float = Field(
        0.0, ge=-MAX_OPENAI_PENALTY, le=MAX_OPENAI_PENALTY, allow_inf_nan=False
    )
    # OpenAI's: token id (as a string) → added to its logit, in [-100, 100]
    logit_bias: dict[BiasedToken, Bias] | None = Field(None, max_length=MAX_LOGIT_BIAS)

    def sampling_fields(self) -> dict[str, Any]:
        """These settings as keyword arguments, for building another request (already
        validated) that samples the same way."""
        return {field: getattr(self, field) for field in SamplingRequest.model_fields}

    def sampling_params(
        self, vocab: int, seed: int | None = None, grammar: str | None = None
    ) -> SamplingParams:
        """These settings for a model of ``vocab`` tokens: a top_k that keeps the whole
        vocabulary is off, so it draws exactly as top_k 0 (and never overflows int64).
        ``grammar``: llguidance's text of the output's constraint (``server.api.structured``).
        Raises a 400 APIError for a logit_bias token outside the vocabulary."""
        bias = tuple((int(token), value) for token, value in (self.logit_bias or {}).items())
        outside = [token for token, _ in bias if token >= vocab]
        if outside:
            raise APIError(
                400,
                f"logit_bias: token id {outside[0]} is outside the model's vocabulary [0, {vocab})",
                param="logit_bias",
            )
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k if self.top_k < vocab else 0,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logit_bias=bias,
            seed=seed,
            grammar=grammar,
        )


class PromptRequest(SamplingRequest):
    """A prompt (text, or token ids) and its sampling settings: what traces read."""

    prompt: Prompt


# A field of OpenAI's API that ordinal does not implement. The check is separate, so that each
# field names its own no-op value: ``name: Annotated[Unsupported, refused_unless(noop)] = None``.
Unsupported = Annotated[Any, Field(description="not supported")]


def refused_unless(noop: Any = None, why: str = "") -> AfterValidator:
    """The check of an Unsupported field: absent, null or its no-op value ``noop`` is accepted
    (clients send defaults); anything else is a 400 saying so (and ``why``), never "extra
    inputs are not permitted"."""

    def refuse(value: Any) -> None:
        if value is None or (noop is not None and value == noop):
            return None
        only = f" (only {json.dumps(noop)}, a no-op, is accepted)" if noop is not None else ""
        raise ValueError(f"is not supported by ordinal{only}{why}")

    return AfterValidator(refuse)


@dataclass(frozen=True)
class Constraint:
    """What a request's output must keep to (``model.grammar.grammar_of``'s kind and spec), and
    the field that asked for it, which a 400 about it names (``response_format.json_schema``'s
    ``schema``: ``response_format.json_schema.schema``)."""

    kind: Kind
    spec: Any
    field: str

    @property
    def param(self) -> str:
        """The top-level field (an error's ``param``)."""
        return self.field.split(".")[0].split("[")[0]


ANY_JSON_OBJECT = {"type": "object"}
JsonSchema = dict[str, Any]


class _HasText(Protocol):
    text: str


def content_text(content: str | Sequence[_HasText] | None) -> str:
    """A message's content as one text: a string as it is, text parts (chat's, Responses',
    Anthropic's blocks) joined in order."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def only_one(constraints: list[Constraint | None]) -> Constraint | None:
    """The one constraint given (None: none); a 400 naming the second when two are."""
    given = [constraint for constraint in constraints if constraint is not None]
    if len(given) > 1:
        raise APIError(
            400,
            f"{given[1].field}: the output is already constrained by {given[0].field}; "
            "send one of them",
            param=given[1].param,
        )
    return given[0] if given else None


class StructuredOutputs(StrictBody):
    """vLLM's ``structured_outputs``: one of ``choice`` (the output is one of these strings),
    ``regex`` (it matches the whole pattern), ``json`` (a JSON schema, or its text) and
    ``grammar`` (Lark, or llama.cpp's GBNF), or ``json_object: true`` (any JSON object)."""

    choice: list[Text] | None = None
    regex: Text | None = None
    json_schema: JsonSchema | Text | None = Field(None, alias="json")
    grammar: Text | None = None
    json_object: bool | None = None

    def constraint(self, field: str = "structured_outputs") -> Constraint | None:
        given: list[tuple[Kind, Any, str]] = [
            ("choice", self.choice, "choice"),
            ("regex", self.regex, "regex"),
            ("json", self.json_schema, "json"),
            ("grammar", self.grammar, "grammar"),
            ("json", ANY_JSON_OBJECT if self.json_object else None, "json_object"),
        ]
        return only_one(
            [
                Constraint(kind, spec, f"{field}.{name}")
                for kind, spec, name in given
                if spec is not None
            ]
        )


class Structured(StrictBody):
    """The constraints vLLM accepts on completions and chat: ``structured_outputs``, and its
    older top-level ``guided_choice``, ``guided_regex``, ``guided_json``, ``guided_grammar``."""

    structured_outputs: StructuredOutputs | None = None
    guided_choice: list[Text] | None = None
    guided_regex: Text | None = None
    guided_json: JsonSchema | Text | None = None
    guided_grammar: Text | None = None

    def constraint(self) -> Constraint | None:
        """The request's constraint (None: free text); a 400 when it asks for two."""
        guided = StructuredOutputs.model_construct(
            choice=self.guided_choice,
            regex=self.guided_regex,
            json_schema=self.guided_json,
            grammar=self.guided_grammar,
        )
        old = [
            Constraint(c.kind, c.spec, c.field.replace("guided.", "guided_"))
            for c in [guided.constraint("guided")]
            if c is not None
        ]
        new = self.structured_outputs.constraint() if self.structured_outputs else None
        return only_one([new, *old])


class OpenAIHints(StrictBody):
    """Fields of OpenAI's API that only inform OpenAI's own service (storage, caching, abuse
    tracking): accepted and ignored, which is what honouring them means here."""

    user: Text | None = None
    metadata: dict[Text, Text] | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None
    service_tier: Text | None = None


class Queued(StrictBody):
    """How a generating request is queued: vLLM's ``priority``, lower served sooner (a request
    of priority -1 is admitted before every waiting one of 0 that arrived less than
    ``--priority-aging`` s before it; arrival order among equals). Who may claim which priority:
    ``server.api.priority``."""

    priority: int = Field(0, ge=-(2**31), lt=2**31)


class CompletionRequest(SamplingRequest, OpenAIHints, Queued, Structured):
    """``POST /v1/completions``, as in OpenAI's legacy completions API."""

    # OpenAI's four forms: a text, token ids, or a list of either (one prompt each)
    prompt: Prompt | list[Text] | list[list[TokenId]]
    echo: bool = False  # declared before max_tokens, whose check reads it
    max_tokens: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: Stops = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    n: int = Field(1, ge=1, le=MAX_N)  # choices per prompt; choice j draws with seed + j
    best_of: Annotated[Unsupported, refused_unless(1)] = None
    suffix: Annotated[Unsupported, refused_unless("")] = None
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

    @property
    def stops(self) -> list[str]:
        """``stop`` as a list (the validator has normalised it)."""
        return list(self.stop or [])

    @property
    def prompts(self) -> list[Prompt]:
        """Each prompt of ``prompt``: one text or one list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [cast(Prompt, prompt)]  # the checker cannot narrow a list by its first item
        return list(prompt)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM's continuous_usage_stats, which needs include_usage)."""
        options = self.stream_options
        return self.include_usage and bool(options and options.continuous_usage_stats)


# A speaker's name, as the plays write them ("FIRST CITIZEN", "LADY MACBETH", "Romeo").
Speaker = Annotated[str, Field(pattern=r"^[A-Za-z][A-Za-z .'-]{0,39}$")]


class TextPart(StrictBody):
    type: Literal["text"]
    text: Text


class ChatMessage(StrictBody):
    """One message of a chat: a speech. ``developer`` is OpenAI's newer name for ``system``."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Speaker | None = None  # who speaks it; default per role (model.chat.DEFAULT_SPEAKERS)

    @property
    def text(self) -> str:
        return content_text(self.content)


class JsonObjectFormat(StrictBody):
    type: Literal["json_object"]


class JsonSchemaSpec(StrictBody):
    name: Text = Field(max_length=64)
    description: Text | None = None
    schema_: JsonSchema | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the output keeps to the schema either way


class JsonSchemaFormat(StrictBody):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class TextFormat(StrictBody):
    type: Literal["text"]


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


def format_constraint(
    form: TextFormat | JsonObjectFormat | JsonSchemaFormat | None, field: str
) -> Constraint | None:
    """A ``response_format``'s constraint: none for text, any JSON object, or the schema."""
    if isinstance(form, JsonObjectFormat):
        return Constraint("json", ANY_JSON_OBJECT, f"{field}.type")
    if isinstance(form, JsonSchemaFormat):
        schema = form.json_schema.schema_
        return Constraint("json", schema or ANY_JSON_OBJECT, f"{field}.json_schema.schema")
    return None


ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # OpenAI's rule


class FunctionDefinition(StrictBody):
    name: ToolName
    description: Text | None = None
    parameters: JsonSchema | None = None  # None: no arguments ({})
    strict: bool | None = None  # the arguments keep to the schema either way


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictBody):
    name: ToolName


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: FunctionName


CANNOT_DECIDE = (
    'this model cannot decide whether to call a tool: send tool_choice "required" (or '
    '{"type": "function", "function": {"name": ...}}) to have it call one, or "none"'
)
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolCall:
    """The call a chat request asks for: one of ``names`` (the only one: its arguments are the
    whole output; several: the output is ``{"name", "arguments"}``)."""

    names: list[str]
    constraint: Constraint


def tool_call_of(
    tools: Sequence[tuple[str, JsonSchema | None]],
    named: str | None,
    name_field: str,
    schema_field: str,
) -> ToolCall:
    """The call of one of ``tools`` (name, schema of its arguments; None: none): the tool
    ``named`` (a 400 naming ``name_field`` when none is), else any of them. The field of a
    tool's schema, in a 400 about it, is ``tools[i].`` + ``schema_field``."""
    chosen = list(range(len(tools)))
    if named is not None:
        chosen = [i for i, (name, _) in enumerate(tools) if name == named][:1]
        if not chosen:
            param = name_field.split(".")[0]
            raise APIError(400, f"{name_field}: no tool is named {named!r}", param=param)
    if len(chosen) == 1:
        name, schema = tools[chosen[0]]
        field = f"tools[{chosen[0]}].{schema_field}"
        return ToolCall([name], Constraint("json", schema or NO_ARGUMENTS, field))
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": schema or NO_ARGUMENTS},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, schema in tools
    ]
    return ToolCall([name for name, _ in tools], Constraint("json", {"anyOf": calls}, "tools"))


class ChatRequest(SamplingRequest, OpenAIHints, Queued, Structured):
    """``POST /v1/chat/completions``, as in OpenAI's chat completions API."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)  # OpenAI's older name of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: Stops = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # needs logprobs: true
    n: int = Field(1, ge=1, le=MAX_N)  # choices; choice j draws with seed + j
    ignore_eos: bool = False
    audio: Annotated[Unsupported, refused_unless()] = None
    function_call: Annotated[Unsupported, refused_unless()] = None
    functions: Annotated[Unsupported, refused_unless()] = None
    modalities: Annotated[Unsupported, refused_unless(["text"])] = None
    parallel_tool_calls: bool | None = None  # one call is made either way
    prediction: Annotated[Unsupported, refused_unless()] = None
    reasoning_effort: Annotated[Unsupported, refused_unless()] = None
    response_format: ResponseFormat | None = None
    store: Annotated[Unsupported, refused_unless(False)] = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    verbosity: Annotated[Unsupported, refused_unless()] = None
    web_search_options: Annotated[Unsupported, refused_unless()] = None

    @field_validator("top_logprobs")
    @classmethod
    def _only_with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    @property
    def token_budget(self) -> int | None:
        """The most tokens the reply may have (None: as many as the context has room for)."""
        return self.max_completion_tokens or self.max_tokens

    def tool_call(self) -> ToolCall | None:
        """The tool call asked for (None: a message): ``tool_choice`` "required" or a named
        function, served as JSON constrained by the function's parameters. A 400 for tools
        the model would have to decide to call ("auto", or no tool_choice) and for a name
        not among ``tools``."""
        tools, choice = self.tools or [], self.tool_choice
        if choice == "none" or (not tools and choice is None):
            return None
        if not tools:
            raise APIError(400, "tool_choice: there are no tools to call", param="tool_choice")
        if choice is None or choice == "auto":
            field = "tool_choice" if choice else "tools"
            raise APIError(400, f"{field}: {CANNOT_DECIDE}", param=field)
        functions = [(tool.function.name, tool.function.parameters) for tool in tools]
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        return tool_call_of(functions, named, "tool_choice.function.name", "function.parameters")

    def constraint(self) -> Constraint | None:
        """The reply's constraint: a tool call's, ``response_format``'s or vLLM's fields'
        (a 400 when two are given)."""
        call = self.tool_call()
        return only_one(
            [
                call.constraint if call else None,
                format_constraint(self.response_format, "response_format"),
                super().constraint(),
            ]
        )


class InputText(StrictBody):
    """A part of a Responses message: the client's text, or a reply it got before (with the
    annotations and logprobs that came with it, which are read as nothing but its text)."""

    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(StrictBody):
    """An item of a Responses ``input``: a message (the output items of an earlier response,
    passed back as they came, are messages too)."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[InputText]
    name: Speaker | None = None  # ordinal's, as in chat: who speaks it
    id: Text | None = None  # an earlier output item's, as the SDK passes it back
    status: Text | None = None
    phase: Text | None = None

    @property
    def text(self) -> str:
        return content_text(self.content)


class ResponsesJsonSchema(StrictBody):
    """The Responses API's ``text.format`` for a schema: the chat format's fields, flattened."""

    type: Literal["json_schema"]
    name: Text = Field(max_length=64)
    description: Text | None = None
    schema_: JsonSchema = Field(alias="schema")
    strict: bool | None = None


class ResponseText(StrictBody):
    format: (
        Annotated[TextFormat | JsonObjectFormat | ResponsesJsonSchema, Field(discriminator="type")]
        | None
    ) = None
    verbosity: Annotated[Unsupported, refused_unless()] = None


STATELESS = ": ordinal keeps no responses; send the whole conversation as input"


class ResponsesRequest(SamplingRequest, OpenAIHints, Queued):
    """``POST /v1/responses``, stateless: ``instructions`` and ``input`` are a conversation,
    rendered as a chat scene; nothing is stored, so nothing can be continued by id."""

    input: Text | Annotated[list[InputMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = None  # the scene's setting: a system message before the input
    max_output_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**64)  # ordinal's, as in chat
    stream: bool = False
    text: ResponseText | None = None
    ignore_eos: bool = False
    store: Annotated[Unsupported, refused_unless(False, STATELESS)] = None
    previous_response_id: Annotated[Unsupported, refused_unless(why=STATELESS)] = None
    conversation: Annotated[Unsupported, refused_unless(why=STATELESS)] = None
    background: Annotated[Unsupported, refused_unless(False)] = None
    include: Annotated[Unsupported, refused_unless([])] = None
    max_tool_calls: Annotated[Unsupported, refused_unless()] = None
    parallel_tool_calls: Annotated[Unsupported, refused_unless()] = None
    prompt: Annotated[Unsupported, refused_unless()] = None
    reasoning: Annotated[Unsupported, refused_unless()] = None
    stream_options: Annotated[Unsupported, refused_unless()] = None
    tool_choice: Annotated[Unsupported, refused_unless("none")] = None
    tools: Annotated[Unsupported, refused_unless([])] = None
    top_logprobs: Annotated[Unsupported, refused_unless(0)] = None
    truncation: Annotated[Unsupported, refused_unless("disabled")] = None

    def constraint(self) -> Constraint | None:
        """The output's constraint, from ``text.format`` (None: free text)."""
        form = self.text.format if self.text else None
        if isinstance(form, ResponsesJsonSchema):
            return Constraint("json", form.schema_, "text.format.schema")
        if isinstance(form, JsonObjectFormat):
            return format_constraint(form, "text.format")
        return None

    def chat(self) -> ChatRequest:
        """The same conversation and settings as a chat request (already validated)."""
        items = (
            [InputMessage(role="user", content=self.input)]
            if isinstance(self.input, str)
            else self.input
        )
        if self.instructions is not None:
            items = [InputMessage(role="developer", content=self.instructions), *items]
        messages = [
            ChatMessage.model_construct(role=item.role, content=item.text, name=item.name)
            for item in items
        ]
        return ChatRequest.model_construct(
            **self.sampling_fields(),
            messages=messages,
            max_tokens=None,
            max_completion_tokens=self.max_output_tokens,
            seed=self.seed,
            stop=[],
            stream=self.stream,
            stream_options=None,
            logprobs=False,
            top_logprobs=None,
            n=1,
            user=self.user,
            ignore_eos=self.ignore_eos,
            priority=self.priority,
        )


class ModelHealth(BaseModel):
    state: Literal["loading", "ready", "failed"]
    message: str | None = None  # why it failed


class HealthDocument(BaseModel):
    """``GET /health``: ok (every model ready), degraded (some), loading or failed (none)."""

    status: Literal["ok", "degraded", "loading", "failed"]
    models: dict[str, ModelHealth]


class TokenizeRequest(StrictBody):
    """``POST /v1/tokenize`` and vLLM's ``POST /tokenize``: the ids a prompt becomes (with
    ``<|bos|>`` unless told not to), and vLLM's ``token_strs`` when asked."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


# A longer trace prompt is a 400 (context_length_exceeded): the response grows as T².
MAX_TRACE_TOKENS = 256
DEFAULT_TRACE_TOP = 20


MAX_POSITION_OFFSET = 2**20  # past any table; a formula scheme is still exact in float32 there
DEFAULT_LENS_TOP = 3


class HeadRef(StrictBody):
    layer: int = Field(ge=0, description="0 is the first block")
    head: int = Field(ge=0)


class TraceRequest(PromptRequest, Structured):
    """``POST /v1/trace``: one forward pass over the prompt, and the next token's distribution
    through each sampling stage for these settings (validated exactly like completions).

    ``top``: how many of the most probable tokens each stage lists (capped at the vocabulary;
    the whole vocabulary lists every token). ``attention``: false leaves the attention weights
    out, for a caller that wants only the positional pieces or the next token.

    The interventions (``position_offset``, ``ablate``, ``drop_positional``) change the forward
    pass itself (``model.transformer.Intervention``): every field of the response, attention
    and surprisal included, is that of the changed pass. Layers and heads past the model's are
    a 400, and so is an offset that takes a position past a table's last row. A constraint
    (``structured_outputs``, ``guided_*``) adds its ``grammar`` stage: the first token's mask.
    """

    top: int = Field(DEFAULT_TRACE_TOP, ge=1, le=2**16)
    attention: bool = Field(
        True,
        description="include every layer's attention weights (most of the response: "
        "layers × heads × T(T+1)/2 numbers); false answers attention null",
    )
    attention_encoding: Literal["lists", "uint8"] = Field(
        "lists",
        description='"uint8": attention comes as attention_uint8, a quarter of the bytes, for a '
        "page that draws it",
    )
    position_offset: int = Field(
        0,
        ge=0,
        le=MAX_POSITION_OFFSET,
        description="shift every position by k, as if the prompt started at position k",
    )
    ablate: list[HeadRef] = Field(
        default_factory=list,
        max_length=4096,
        description="heads whose attention output is zeroed",
    )
    drop_positional: list[Annotated[int, Field(ge=0)]] | Literal["all"] = Field(
        default_factory=list,
        description='layers (or "all") where the scheme\'s positional signal is removed: no '
        "rotation, no score bias, and no added vector when layer 0 is dropped",
    )
    logit_lens: bool = Field(
        False,
        description="every layer's residual stream read through the final norm and the "
        "unembedding: its top tokens at each position",
    )
    score_parts: HeadRef | None = Field(
        None,
        description="split this head's scores of the last query into content and position "
        "(and, for rope, each rotation pair's share)",
    )
    attribution: bool = Field(
        False,
        description="split the next-token logit of target into the embedding, the positional "
        "vector, each head and each MLP",
    )
    target: TokenId | None = Field(
        None, description="the token attribution explains; null: the most probable one"
    )


# A patch runs the corrupted prompt once for each layer and position: (layers + 1) × T passes.
MAX_PATCH_TOKENS = 128


class PatchRequest(StrictBody):
    """``POST /v1/patch``: activation patching of two prompts of one length (text or token
    ids, tokenised as a prompt is)."""

    model: Text | None = None
    clean: Prompt
    corrupted: Prompt
    target: TokenId | None = Field(
        None, description="the token whose logit is restored; null: clean's most probable"
    )


class DetokenizeRequest(StrictBody):
    """``POST /v1/detokenize`` and vLLM's ``POST /detokenize``: the text of token ids."""

    model: Text | None = None
    tokens: list[TokenId] = Field(max_length=1_000_000)
