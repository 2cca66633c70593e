"""``POST /v1/responses``, stateless: OpenAI's Responses API over the chat path.

``instructions`` and ``input`` become a conversation (``ResponsesRequest.chat``), which the chat
endpoint's own code turns into a scene and a job; :class:`ResponsesWriter` writes the pieces the
job yields in the Responses shape: one ``response`` object with one assistant message whose one
part is ``output_text``, or, streaming, the event sequence OpenAI sends — ``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``, a
``response.output_text.delta`` per piece of text, then ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done`` and ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` ran out), each ``event: TYPE`` with a
``sequence_number``. ``text.format`` constrains the text as chat's ``response_format`` does
(a JSON schema, or any JSON object). Nothing is stored: ``store: true`` and
``previous_response_id`` are 400s.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from functools import partial
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from server.api.chat import chat_jobs
from server.api.completions import respond
from server.api.schemas import CompletionRequest, ResponsesRequest
from server.api.service import ServedModel, Service
from server.api.writer import ChatWriter, CompletionWriter, Piece


async def create_response(body: ResponsesRequest, request: Request, service: Service) -> Response:
    """Answer one Responses request (400/404/429/503 are raised as APIError)."""
    served = service.get(body.model)
    writer = partial(ResponsesWriter, body)
    jobs, writers = await chat_jobs(body.chat(), served, writer, body.constraint())
    return await respond(jobs, writers, served, request, service)


class ResponsesWriter(ChatWriter):
    """A chat job's pieces as a Responses ``response`` object or its stream of events."""

    OBJECT, ID_PREFIX = "response", "resp"
    END = b""  # a Responses stream ends with its last event: no [DONE]

    def __init__(
        self,
        request: ResponsesRequest,
        body: CompletionRequest,
        served: ServedModel,
        prompt_ids: list[int],
        index: int = 0,
    ):
        super().__init__(body, served, prompt_ids, index)
        self.request = request
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.text = ""
        self.sequence = 0
        self.started = False
        form = request.text.format if request.text else None
        self.text_format = form.model_dump(by_alias=True) if form else {"type": "text"}

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"

    def _part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def _item(self, status: str) -> dict[str, Any]:
        content = [self._part()] if status == "completed" else []
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def _response(self, finish_reason: str | None) -> dict[str, Any]:
        request = self.request
        status = {None: "in_progress", "length": "incomplete"}.get(finish_reason, "completed")
        done = finish_reason is not None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": self.model,
            "output": [self._item("completed")] if done else [],
            "parallel_tool_calls": False,
            "previous_response_id": None,
            "store": False,
            "temperature": request.temperature,
            "text": {"format": self.text_format},
            "tool_choice": "none",
            "tools": [],
            "top_p": request.top_p,
            "truncation": "disabled",
            "usage": self.usage() if done else None,
            "user": request.user,
            "metadata": request.metadata or {},
        }

    def usage(self) -> dict[str, Any]:  # the Responses shape
        prompt = len(self.prompt_ids)
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + self.completion_tokens,
        }

    def chunk(self, piece: Piece, usage: dict[str, Any] | None = None) -> bytes:
        text, _, finish_reason = piece
        events = []
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        if not self.started:
            self.started = True
            opening = self._response(None)
            events.append(self._event("response.created", response=opening))
            events.append(self._event("response.in_progress", response=opening))
            item = self._item("in_progress")
            events.append(self._event("response.output_item.added", output_index=0, item=item))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._event("response.content_part.added", **where, part=part))
        if text:
            self.text += text
            events.append(
                self._event("response.output_text.delta", **where, delta=text, logprobs=[])
            )
        if finish_reason is not None:
            events.append(
                self._event("response.output_text.done", **where, text=self.text, logprobs=[])
            )
            events.append(self._event("response.content_part.done", **where, part=self._part()))
            item = self._item("completed")
            events.append(self._event("response.output_item.done", output_index=0, item=item))
            final = self._response(finish_reason)
            kind = (
                "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            )
            events.append(self._event(kind, response=final))
        return b"".join(events)

    def result(self, pieces: list[Piece]) -> dict[str, Any]:
        self.text = "".join(text for text, _, _ in pieces)
        return self._response(pieces[-1][2])

    def combine(
        self, results: list[dict[str, Any]], writers: Sequence[CompletionWriter]
    ) -> dict[str, Any]:
        return results[0]  # one output message: a Responses request has no n
