"""A request as the engine sees it, and the events its model thread sends back.

A :class:`Job` is created on the event loop, handed to a model's engine, and read from the loop:
the engine's thread puts events into ``job.events`` (an asyncio.Queue) through
``loop.call_soon_threadsafe``, one wake-up per decode step for all jobs of that step.
"""

from __future__ import annotations

import asyncio
import time
from enum import StrEnum
from typing import NamedTuple

from model.generate import SequenceState
from model.sampling import RowSampler, SamplingParams
from server.errors import APIError


class TokenEvent(NamedTuple):
    """One generated token, the text it completes (maybe ``""``) and, if asked, its logprobs."""

    token: int
    text: str
    finish_reason: str | None  # set on the job's last token: "stop" | "length"
    logprob: float | None = None
    top_ids: list[int] | None = None
    top_values: list[float] | None = None


class PromptScores(NamedTuple):
    """Log-probabilities of the prompt's tokens after the first (a full forward pass)."""

    logprobs: list[float]
    top_ids: list[list[int]]
    top_values: list[list[float]]


class Failure(NamedTuple):
    """The job ended without finishing: the engine failed or stopped, or the request expired."""

    error: APIError


Event = TokenEvent | PromptScores | Failure
EXPIRED = Failure(APIError(504, "the request took longer than the server's request timeout"))


class Stage(StrEnum):
    """Where a job is, as the engine's thread sees it."""

    NEW = "new"  # created on the event loop, not yet read from the inbox
    QUEUED = "queued"  # waiting for a batch row
    RUNNING = "running"  # decoding in a row (or having its prompt scored)
    DONE = "done"  # finished, failed or cancelled: it holds nothing in the engine


class Job:
    """One completion request: what to compute, and the queue its results arrive in.

    ``state`` is None when the request only scores its prompt (echo with max_tokens 0).
    ``row`` and ``stage`` belong to the engine's thread; ``closed`` to the event loop.
    """

    def __init__(
        self,
        prompt_ids: list[int],
        state: SequenceState | None,
        params: SamplingParams,
        logprobs: int | None,
        score_prompt: bool,
    ) -> None:
        self.prompt_ids = prompt_ids
        self.state = state
        self.sampler = RowSampler(params)
        self.logprobs = logprobs
        self.score_prompt = score_prompt
        self.submitted_at = time.perf_counter()
        self.admitted_at = self.first_token_at = 0.0  # set by the engine
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.closed = False  # loop side: the final event was read, or the job was cancelled
        self.stage = Stage.NEW  # engine side: NEW → QUEUED → RUNNING → DONE
        self.row: int | None = None

    async def next_events(self) -> list[Event]:
        """Wait for at least one event; return every event that has arrived, in order."""
        events = [await self.events.get()]
        while not self.events.empty():
            events.append(self.events.get_nowait())
        return events

    def expire(self) -> None:
        """Called by the request's timer: the reader sees a 504 Failure next."""
        self.events.put_nowait(EXPIRED)
