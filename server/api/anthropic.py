"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API over the chat
path, as the Responses API is (``server.api.responses``).

``system`` and ``messages`` become a chat conversation (:meth:`MessagesRequest.chat`), which the
chat endpoint's own code renders as a scene and runs as a job; :class:`MessagesWriter` writes the
pieces the job yields in Anthropic's shape: one ``message`` whose content is one ``text`` block
(or one ``tool_use`` block), or, streaming, Anthropic's event sequence — ``message_start``,
``content_block_start``, a ``content_block_delta`` per piece (``text_delta``, or a tool's
``input_json_delta``), ``content_block_stop``, ``message_delta`` (``stop_reason``, cumulative
``usage``) and ``message_stop``, each ``event: TYPE``. A stream that fails after it started
ends with an ``error`` event.

``stop_reason``: ``end_turn`` where the reply ended (``<|eos|>``, or another speaker of the
scene), ``stop_sequence`` (with ``stop_sequence``) where one of the request's
``stop_sequences`` ended it, ``max_tokens``, or ``tool_use``. ``usage`` counts as Anthropic
does: ``input_tokens`` are the prompt tokens computed, ``cache_read_input_tokens`` those reused
from the prefix cache (their sum is chat's ``prompt_tokens``, and ``count_tokens``' answer).

Tools work as chat's: ``tool_choice`` ``{"type": "any"}`` or ``{"type": "tool", "name"}`` has the
model write the tool's input as JSON constrained by its ``input_schema``; ``auto`` (the default
when tools are given) is a 400, since these models cannot decide. Only text content blocks are
read. Errors on these routes take Anthropic's shape (``server.api.errors``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from functools import partial
from typing import Annotated, Any, Literal

import orjson
from pydantic import Field, field_validator
from starlette.requests import Request
from starlette.responses import Response

from server.api.chat import chat_jobs, render_scene
from server.api.completions import respond
from server.api.errors import APIError
from server.api.schemas import (
    MAX_MESSAGES,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    Constraint,
    JsonSchema,
    Queued,
    SamplingRequest,
    Speaker,
    StrictBody,
    Text,
    ToolCall,
    ToolName,
    Unsupported,
    content_text,
    only_one,
    refused_unless,
    tool_call_of,
)
from server.api.service import ServedModel, Service
from server.api.writer import ChatWriter, CompletionWriter, Piece
from server.messages import Token

MAX_STOP_SEQUENCES = 16  # Anthropic documents no cap; each is looked for after every token
CANNOT_DECIDE = (
    'this model cannot decide whether to use a tool: send tool_choice {"type": "any"} (or '
    '{"type": "tool", "name": ...}) to have it use one, or {"type": "none"}'
)


# ---- the request ---------------------------------------------------------------------------


class TextBlock(StrictBody):
    type: Literal["text"]
    text: Text
    cache_control: dict[str, Any] | None = None  # a hint: every prompt's prefix is cached
    citations: Annotated[Unsupported, refused_unless([])] = None


def _text_blocks_only(value: Any) -> Any:
    """A clear 400 for a content block that is not text (images, documents, tool_use and
    tool_result blocks, thinking), rather than pydantic's list of what it is not."""
    if isinstance(value, list):
        for index, block in enumerate(value):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(
                    f"block {index} is a {kind!r} block; ordinal reads only text content blocks"
                )
    return value


class InputMessage(StrictBody):
    """One message of ``messages``. ``system`` here is the SDK's newer spelling of a system
    prompt in the conversation."""

    role: Literal["user", "assistant", "system"]
    content: Text | list[TextBlock]
    name: Speaker | None = None  # ordinal's, as in chat: who speaks it

    _only_text = field_validator("content", mode="before")(_text_blocks_only)

    @property
    def text(self) -> str:
        return content_text(self.content)


class Tool(StrictBody):
    """A client tool: the model writes its ``input``, a JSON object kept to ``input_schema``."""

    name: ToolName
    description: Text | None = None
    input_schema: JsonSchema
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None  # the input keeps to the schema either way

    @field_validator("input_schema")
    @classmethod
    def _an_object(cls, value: JsonSchema) -> JsonSchema:
        if value.get("type") != "object":
            raise ValueError('must be a JSON schema of "type": "object" (a tool\'s input is one)')
        return value


class ChoiceAuto(StrictBody):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None  # one tool use is made either way


class ChoiceAny(StrictBody):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ChoiceTool(StrictBody):
    type: Literal["tool"]
    name: ToolName
    disable_parallel_tool_use: bool | None = None


class ChoiceNone(StrictBody):
    type: Literal["none"]


ToolChoice = Annotated[
    ChoiceAuto | ChoiceAny | ChoiceTool | ChoiceNone, Field(discriminator="type")
]


class JsonFormat(StrictBody):
    type: Literal["json_schema"]
    schema_: JsonSchema = Field(alias="schema")


class OutputConfig(StrictBody):
    """Anthropic's structured outputs: ``format`` constrains the text to a JSON schema."""

    format: JsonFormat | None = None
    effort: Annotated[Unsupported, refused_unless()] = None


class Metadata(StrictBody):
    user_id: Text | None = None


class Conversation(StrictBody):
    """What both routes read: the model, ``system``, ``messages`` and the tools."""

    model: Text | None = None  # None: the server's default model
    messages: list[InputMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Text | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: Annotated[Unsupported, refused_unless({"type": "disabled"})] = None
    cache_control: dict[str, Any] | None = None  # a hint: every prompt's prefix is cached
    container: Annotated[Unsupported, refused_unless()] = None
    context_management: Annotated[Unsupported, refused_unless()] = None
    mcp_servers: Annotated[Unsupported, refused_unless([])] = None

    _only_text = field_validator("system", mode="before")(_text_blocks_only)

    def conversation(self) -> list[ChatMessage]:
        """``system`` and ``messages`` as chat messages (already validated)."""
        messages = [(m.role, m.text, m.name) for m in self.messages]
        if self.system is not None:
            messages.insert(0, ("system", content_text(self.system), None))
        return [
            ChatMessage.model_construct(role=role, content=text, name=name)
            for role, text, name in messages
        ]


class MessagesRequest(Conversation, SamplingRequest, Queued):
    """``POST /v1/messages``, as in Anthropic's Messages API (and vLLM's sampling extensions,
    as chat takes them)."""

    max_tokens: int = Field(ge=1)
    temperature: float = Field(1.0, ge=0, le=1, allow_inf_nan=False)  # Anthropic's range
    stop_sequences: list[Text] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Text | None = None  # a hint for Anthropic's own service
    seed: int | None = Field(None, ge=0, lt=2**64)  # ordinal's, as in chat
    ignore_eos: bool = False  # vLLM's, as in chat
    inference_geo: Annotated[Unsupported, refused_unless()] = None
    speed: Annotated[Unsupported, refused_unless("standard")] = None

    @field_validator("stop_sequences")
    @classmethod
    def _not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value and "" in value:
            raise ValueError("an empty stop sequence would end every reply before it starts")
        return value

    def tool_call(self) -> ToolCall | None:
        """The tool use asked for (None: text): ``tool_choice`` any, or a named tool, served as
        JSON kept to its ``input_schema``; a 400 for auto (what tools default to) and for a
        name not among ``tools``."""
        tools, choice = self.tools or [], self.tool_choice
        if isinstance(choice, ChoiceNone) or (not tools and choice is None):
            return None
        if not tools:
            raise APIError(400, "tool_choice: there are no tools to use", param="tool_choice")
        if choice is None or isinstance(choice, ChoiceAuto):
            field = "tool_choice" if choice else "tools"
            raise APIError(400, f"{field}: {CANNOT_DECIDE}", param=field)
        named = choice.name if isinstance(choice, ChoiceTool) else None
        schemas = [(tool.name, tool.input_schema) for tool in tools]
        return tool_call_of(schemas, named, "tool_choice.name", "input_schema")

    def constraint(self) -> Constraint | None:
        """The reply's constraint: a tool's input schema or ``output_config.format``'s."""
        call = self.tool_call()
        form = self.output_config.format if self.output_config else None
        schema = None
        if form is not None:
            schema = Constraint("json", form.schema_, "output_config.format.schema")
        return only_one([call.constraint if call else None, schema])

    def chat(self) -> ChatRequest:
        """The same conversation and settings as a chat request (already validated)."""
        return ChatRequest.model_construct(
            **self.sampling_fields(),
            messages=self.conversation(),
            max_tokens=self.max_tokens,
            max_completion_tokens=None,
            seed=self.seed,
            stop=list(self.stop_sequences or []),
            stream=self.stream,
            stream_options=None,
            logprobs=False,
            top_logprobs=None,
            n=1,
            user=self.metadata.user_id if self.metadata else None,
            ignore_eos=self.ignore_eos,
            priority=self.priority,
        )


class CountTokensRequest(Conversation):
    """``POST /v1/messages/count_tokens``: the tokens the conversation's prompt takes."""


# ---- the routes' work ----------------------------------------------------------------------


async def create_message(body: MessagesRequest, request: Request, service: Service) -> Response:
    """Answer one Messages request (4xx/5xx are raised as APIError, shaped by the route)."""
    served = service.get(body.model)
    writer = partial(MessagesWriter, body, body.tool_call())
    jobs, writers = await chat_jobs(body.chat(), served, writer, body.constraint())
    return await respond(jobs, writers, served, request, service)


async def count_tokens(body: CountTokensRequest, service: Service) -> dict[str, int]:
    """``input_tokens``: the prompt's tokens, as a Messages request's usage counts them."""
    scene = await render_scene(body.conversation(), service.get(body.model))
    return {"input_tokens": len(scene.prompt_ids)}


class MessagesWriter(ChatWriter):
    """A chat job's pieces as an Anthropic ``message`` or its stream of events."""

    END = b""  # the stream ends with message_stop: no [DONE]

    def __init__(
        self,
        request: MessagesRequest,
        call: ToolCall | None,
        body: CompletionRequest,
        served: ServedModel,
        prompt_ids: list[int],
        index: int = 0,
    ):
        super().__init__(body, served, prompt_ids, index)
        self.request = request
        self.call = call
        self.id = f"msg_{uuid.uuid4().hex}"
        self.tool_id = f"toolu_{uuid.uuid4().hex[:24]}"
        self.stopped_by: str | None = None  # the stop string that ended the reply
        self.text = ""  # streamed so far
        self.started = False

    def _token_piece(self, event: Token) -> Piece:
        if event.stop is not None:
            self.stopped_by = event.stop
        return super()._token_piece(event)

    def usage(self) -> dict[str, Any]:  # Anthropic's shape
        cached = self.cached_tokens
        return {
            "input_tokens": len(self.prompt_ids) - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": self.completion_tokens,
        }

    def _tool_use(self, text: str) -> tuple[str, Any] | None:
        """(the tool's name, its input) that ``text`` writes, or None when it is not a whole
        call (a reply cut short by max_tokens or a stop sequence)."""
        assert self.call is not None
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if len(self.call.names) == 1:
            return self.call.names[0], value
        return value["name"], value["arguments"]

    def _stop(self, finish_reason: str | None, used_tool: bool) -> dict[str, str | None]:
        """``stop_reason`` and ``stop_sequence`` for the job's ``finish_reason``."""
        reason, sequence = "end_turn", None
        if finish_reason == "length":
            reason = "max_tokens"
        elif used_tool:
            reason = "tool_use"
        elif self.stopped_by is not None and self.stopped_by in (self.request.stop_sequences or []):
            reason, sequence = "stop_sequence", self.stopped_by
        return {"stop_reason": reason, "stop_sequence": sequence}

    def _message(self, content: list[dict[str, Any]], stop: dict[str, str | None]) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            **stop,
            "usage": self.usage(),
        }

    def result(self, pieces: list[Piece]) -> dict[str, Any]:
        text, finish_reason = "".join(text for text, _, _ in pieces), pieces[-1][2]
        use = self._tool_use(text) if self.call is not None and finish_reason == "stop" else None
        if use is None:
            content = [{"type": "text", "text": text}]
        else:
            content = [{"type": "tool_use", "id": self.tool_id, "name": use[0], "input": use[1]}]
        return self._message(content, self._stop(finish_reason, use is not None))

    def combine(
        self, results: list[dict[str, Any]], writers: Sequence[CompletionWriter]
    ) -> dict[str, Any]:
        return results[0]  # one message: a Messages request has no n

    # ---- the stream ------------------------------------------------------------------------

    @staticmethod
    def _event(kind: str, **fields: Any) -> bytes:
        data = orjson.dumps({"type": kind, **fields})
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    @property
    def _streams(self) -> bool:
        """Whether the content block opens first and its text streams as it comes: a text, or
        one tool's input. With several tools the name, and so the block, is known only at
        the end."""
        return self.call is None or len(self.call.names) == 1

    def chunk(self, piece: Piece, usage: dict[str, Any] | None = None) -> bytes:
        text, _, finish_reason = piece
        self.text += text
        events = [] if self.started else self._opening()
        self.started = True
        if text and self._streams:
            events.append(self._delta(text))
        if finish_reason is not None:
            events += self._closing(finish_reason)
        return b"".join(events)

    def _opening(self) -> list[bytes]:
        message = self._message([], {"stop_reason": None, "stop_sequence": None})
        message["usage"]["output_tokens"] = 0
        events = [self._event("message_start", message=message)]
        if self._streams:
            block: dict[str, Any] = {"type": "text", "text": ""}
            if self.call is not None:
                name = self.call.names[0]
                block = {"type": "tool_use", "id": self.tool_id, "name": name, "input": {}}
            events.append(self._event("content_block_start", index=0, content_block=block))
        return events

    def _delta(self, text: str) -> bytes:
        delta = (
            {"type": "text_delta", "text": text}
            if self.call is None
            else {"type": "input_json_delta", "partial_json": text}
        )
        return self._event("content_block_delta", index=0, delta=delta)

    def _closing(self, finish_reason: str) -> list[bytes]:
        """The block's end (or, with several tools, the whole block), the stop reason with the
        usage, and message_stop."""
        use = None
        if self.call is not None and finish_reason == "stop":
            use = self._tool_use(self.text)
        if self._streams:
            events = [self._event("content_block_stop", index=0)]
        else:
            block: dict[str, Any] = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": self.text}
            if use is not None:
                block = {"type": "tool_use", "id": self.tool_id, "name": use[0], "input": {}}
                delta = {"type": "input_json_delta", "partial_json": json.dumps(use[1])}
            events = [
                self._event("content_block_start", index=0, content_block=block),
                self._event("content_block_delta", index=0, delta=delta),
                self._event("content_block_stop", index=0),
            ]
        stop = self._stop(finish_reason, use is not None)
        events.append(self._event("message_delta", delta=stop, usage=self.usage()))
        return [*events, self._event("message_stop")]

    def error_event(self, error: APIError) -> bytes:
        return self._event("error", error=error.anthropic_body()["error"])
