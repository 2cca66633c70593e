"""Structured outputs and tool calls in the API process: a request's constraint compiled to
llguidance's grammar (a 400 naming the field when llguidance refuses it), and the writer that
answers a tool call in OpenAI's ``tool_calls`` shape.

Checking compiles the grammar against the model's own tokenizer, off the event loop, within
``model.grammar``'s budgets (a large schema takes a tenth of a second), and walks its first
tokens; the engine compiles it again for its matcher, off its loop.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from model.grammar import GrammarError, grammar_error, grammar_of, grammar_tokenizer
from server.api.errors import APIError
from server.api.offload import GRAMMAR_POOL, in_lane
from server.api.schemas import CompletionRequest, Constraint, ToolCall
from server.api.service import ServedModel
from server.api.writer import ChatWriter, Piece


async def compile_constraint(constraint: Constraint | None, served: ServedModel) -> str | None:
    """llguidance's grammar text for ``constraint`` on ``served`` (None: no constraint)."""
    if constraint is None:
        return None
    try:
        grammar = grammar_of(constraint.kind, constraint.spec)
        error = await in_lane(GRAMMAR_POOL, _check, grammar, served)
    except GrammarError as refused:
        error = str(refused)
    if error is not None:
        raise APIError(400, f"{constraint.field}: {error}", param=constraint.param)
    return grammar


def _check(grammar: str, served: ServedModel) -> str | None:
    return grammar_error(grammar, grammar_tokenizer(served.tokenizer, served.eos))


class ToolCallWriter(ChatWriter):
    """A chat reply that is a tool call: ``message.content`` null and one ``tool_calls`` entry
    whose ``function.arguments`` is the generated JSON, ``finish_reason`` "tool_calls". Streamed,
    a known function's arguments arrive as deltas as they are generated; with several tools the
    name is known only at the end, so the call arrives whole in the last chunk.

    A reply cut short by its token budget keeps ``finish_reason`` "length": its arguments (or,
    with several tools, its text as ``content``) are what was generated, not valid JSON.
    """

    def __init__(
        self,
        call: ToolCall,
        body: CompletionRequest,
        served: ServedModel,
        prompt_ids: list[int],
        index: int = 0,
    ):
        super().__init__(body, served, prompt_ids, index)
        self.call = call
        self.call_id = f"call_{uuid.uuid4().hex[:24]}"
        self.text = ""
        self.opened = False

    @property
    def _named(self) -> str | None:
        """The function's name when the output is its arguments alone."""
        return self.call.names[0] if len(self.call.names) == 1 else None

    def _calls(self, text: str, finish_reason: str | None) -> tuple[list[dict[str, Any]], str]:
        """(the tool calls ``text`` makes, the finish reason to report)."""
        name, arguments = self._named, text
        if name is None:
            if finish_reason != "stop":
                return [], finish_reason or "length"
            call = json.loads(text)
            name, arguments = call["name"], json.dumps(call["arguments"], ensure_ascii=False)
        function = {"name": name, "arguments": arguments}
        reason = "tool_calls" if finish_reason == "stop" else finish_reason or "length"
        return [{"id": self.call_id, "type": "function", "function": function}], reason

    def result(self, pieces: list[Piece]) -> dict[str, Any]:
        answer = super().result(pieces)
        choice = answer["choices"][0]
        text = choice["message"]["content"]
        calls, choice["finish_reason"] = self._calls(text, choice["finish_reason"])
        choice["message"] = {
            "role": "assistant",
            "content": None if calls else text,
            "tool_calls": calls or None,
        }
        return answer

    def chunk(self, piece: Piece, usage: dict[str, int] | None = None) -> bytes:
        text, logprobs, finish_reason = piece
        self.text += text
        delta: dict[str, Any] = {} if self.opened else {"role": "assistant", "content": None}
        reason = finish_reason
        if self._named is not None:  # the arguments, as they come
            call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if not self.opened:
                call.update(id=self.call_id, type="function")
                call["function"] = {"name": self._named, "arguments": text}
            if text or not self.opened:
                delta["tool_calls"] = [call]
            if finish_reason is not None:
                reason = self._calls(self.text, finish_reason)[1]
        elif finish_reason is not None:  # the whole call, once its name is known
            calls, reason = self._calls(self.text, finish_reason)
            if calls:
                delta["tool_calls"] = [{"index": 0, **calls[0]}]
            else:
                delta["content"] = self.text
        self.opened = True
        return self._delta_event(delta, logprobs, reason, usage)
