"""A request as the API process hands it to the engine, and the events that come back.

A :class:`Job` is created on the event loop and submitted to its model's engine
(``server.api.client.ModelClient``), which sends it to the engine process as a ``Submit`` and puts
the events the engine sends back into ``job.events``: :class:`~server.messages.Token` per
generated token, :class:`~server.messages.Scores` for the prompt's logprobs, or a
:class:`Failure`, always the job's last event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import NamedTuple

from model.sampling_params import SamplingParams
from server.api.errors import APIError
from server.messages import Scores, Submit, Token


class Failure(NamedTuple):
    """The job ended without finishing: the engine failed or stopped, or the request expired."""

    error: APIError


Event = Token | Scores | Failure
EXPIRED = "the request took longer than the server's request timeout"


class Job:
    """One completion choice: what to compute, and the queue its results arrive in.

    ``max_tokens`` 0: only score the prompt (echo with logprobs). ``eos_id`` None: <|eos|> is
    an ordinary token (ignore_eos). ``id`` is set when the job is submitted.
    """

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        max_tokens: int,
        stop: Sequence[str] = (),
        eos_id: int | None = None,
        logprobs: int | None = None,
        score_prompt: bool = False,
        priority: int = 0,
    ) -> None:
        self.prompt_ids = prompt_ids
        self.params = params
        self.max_tokens = max_tokens
        self.stop = list(stop)
        self.eos_id = eos_id
        self.logprobs = logprobs
        self.score_prompt = score_prompt
        self.priority = priority  # vLLM's: a lower one is admitted sooner
        self.submitted_at = time.monotonic()
        self.id: int | None = None
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.closed = False  # the final event was read, or the job was cancelled

    @property
    def generates(self) -> bool:
        return self.max_tokens > 0

    def message(self, job_id: int, model: str) -> Submit:
        """The ``Submit`` that runs this job on ``model``."""
        return Submit(
            id=job_id,
            model=model,
            prompt_ids=self.prompt_ids,
            max_tokens=self.max_tokens,
            stop=self.stop,
            eos_id=self.eos_id,
            params=self.params,
            logprobs=self.logprobs,
            score_prompt=self.score_prompt,
            submitted_at=self.submitted_at,
            priority=self.priority,
        )

    def is_last(self, event: Event) -> bool:
        """Whether ``event`` ends the job."""
        if isinstance(event, Token):
            return event.finish_reason is not None
        return isinstance(event, Failure) or not self.generates

    async def next_events(self) -> list[Event]:
        """Wait for at least one event; return every event that has arrived, in order."""
        events = [await self.events.get()]
        while not self.events.empty():
            events.append(self.events.get_nowait())
        return events

    def expire(self) -> None:
        """Called by the request's timer: the reader sees a 504 Failure next. A new error each
        time: one instance raised by every expired request would keep each one's traceback."""
        self.events.put_nowait(Failure(APIError(504, EXPIRED)))
