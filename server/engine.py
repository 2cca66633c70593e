"""Continuous batching: one thread per model runs decode steps for every active request.

Each step of the engine thread:

1. reads its inbox (new jobs, cancellations) — a cancelled job leaves before the next forward;
2. runs one cached decode step for the rows already decoding;
3. admits waiting jobs into free rows and prefills their prompts in one ragged pass;
4. samples every row's next token in one call, hands the text to each job's ``SequenceState``
   (stop strings, UTF-8-safe decoding), lets finished jobs leave at once, and sends the events
   to the event loop with ONE ``call_soon_threadsafe``.

The event loop never waits on the model: it only puts jobs in the inbox and reads events.
Waking the loop costs the engine thread about a fifth of a small model's step (the two threads
share the GIL), so with ``stream_interval`` > 0 a step's events may wait, up to that long plus
one step, to travel with later ones; a job's first and last tokens never wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from enum import StrEnum

import torch

from model.sampling import FailureReason
from model.transformer import Transformer
from server.batch import DecodeBatch, StepLogprobs
from server.errors import APIError, busy
from server.job import Event, Failure, Job, PromptScores, Stage, TokenEvent
from server.metrics import MODEL_ERROR, SHUTDOWN, ModelMetrics

logger = logging.getLogger("ordinal.server")

Delivery = list[tuple[asyncio.Queue, Event]]


class Message(StrEnum):
    """What the event loop asks of the engine's thread, through its inbox."""

    SUBMIT = "submit"  # run this job
    CANCEL = "cancel"  # drop this job wherever it is
    STOP = "stop"  # fail what is left and end the thread


SAMPLING_FAILURES = {
    FailureReason.NON_FINITE_LOGITS: "sampling failed for this request: the model's logits "
    "for it were not finite (the other requests in its batch were not affected)",
    FailureReason.SAMPLING_ERROR: "sampling failed for this request (the other requests in "
    "its batch were not affected)",
}


def _put_all(deliveries: Delivery) -> None:
    """Runs on the event loop: hand each event to its job's queue."""
    for events, event in deliveries:
        events.put_nowait(event)


class Engine:
    """The scheduler of one model. ``submit``/``cancel`` are called from the event loop."""

    def __init__(
        self,
        name: str,
        model: Transformer,
        *,
        vocab: int,
        filler: int,
        max_batch_size: int,
        max_context: int,
        max_queue: int,
        metrics: ModelMetrics,
        stream_interval: float = 0.0,
        threads: int = 1,
    ) -> None:
        self.name = name
        self.batch = DecodeBatch(model, max_batch_size, max_context, vocab, filler)
        self.capacity = max_batch_size + max_queue  # jobs in the engine: decoding or waiting
        self.metrics = metrics
        self._inbox: queue.SimpleQueue[tuple[Message, Job | None]] = queue.SimpleQueue()
        self._waiting: deque[Job] = deque()  # engine thread only
        self._submitted = 0  # written by the event loop only
        self._released = 0  # written by the engine thread only
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._last_step = 0.0
        self.stream_interval = stream_interval
        self.threads = threads
        self._outbox: Delivery = []  # token events not yet sent (engine thread only)
        self._last_delivery = 0.0
        self._admitted: list[Job] = []  # taken from the queue this step (failed with it)

    # ---- event-loop side -------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Stop the thread; jobs still running or waiting get a 503 Failure."""
        self._stopping = True
        self._inbox.put((Message.STOP, None))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    @property
    def in_flight(self) -> int:
        """Jobs submitted and not yet finished (decoding, waiting, or still in the inbox)."""
        return self._submitted - self._released

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises a 429 APIError (Retry-After) when the engine is full."""
        if self._stopping:
            raise busy("the server is shutting down", status=503)
        if self.in_flight >= self.capacity:
            raise busy(
                f"model '{self.name}' is at capacity ({self.capacity} requests running or "
                "queued); retry shortly"
            )
        self._submitted += 1
        self.metrics.waiting.inc()
        self._inbox.put((Message.SUBMIT, job))

    def cancel(self, job: Job) -> None:
        """Stop ``job`` and free its row before the next step (no-op once it has finished)."""
        if not job.closed:
            job.closed = True
            self._inbox.put((Message.CANCEL, job))

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # OpenMP thread counts belong to the calling thread
        with torch.inference_mode():
            while self._read_inbox():
                try:
                    self._step()
                except Exception:  # a failed step fails its jobs, never the thread
                    logger.exception("model '%s': decode step failed", self.name)
                    decoding = self.batch.clear()
                    admitted = [job for job in self._admitted if job.stage != Stage.DONE]
                    jobs = decoding + [job for job in admitted if job not in decoding]
                    self.metrics.failures[MODEL_ERROR].inc(len(jobs))
                    self._fail(jobs, APIError(500, "the model failed on this batch"))
        leftover = [*self.batch.clear(), *self._waiting]
        self._waiting.clear()
        self.metrics.failures[SHUTDOWN].inc(len(leftover))
        self._fail(leftover, busy("the server is shutting down", status=503))

    def _read_inbox(self) -> bool:
        """Take new jobs and cancellations; block while there is nothing to do. False = stop."""
        idle = not self.batch.members and not self._waiting
        while idle or not self._inbox.empty():
            kind, job = self._inbox.get()
            idle = False
            if kind == Message.STOP:
                return False
            assert job is not None
            if kind == Message.SUBMIT:
                job.stage = Stage.QUEUED
                self._waiting.append(job)
            else:
                self._drop(job)
        return True

    def _drop(self, job: Job) -> None:
        """A cancelled job leaves wherever it is."""
        if job.stage == Stage.QUEUED:
            self._waiting.remove(job)
            self.metrics.waiting.dec()
        elif job.stage == Stage.RUNNING:
            self.batch.remove([job])
            self.metrics.running.set(len(self.batch))
        else:
            return
        self.metrics.finished["abort"].inc()
        self._release(job)

    def _release(self, job: Job) -> None:
        job.stage = Stage.DONE
        self._released += 1

    def _step(self) -> None:
        decoding = bool(self.batch.members)
        logits = self.batch.decode() if decoding else None
        joining = self._admit()
        if joining:
            new_logits = self.batch.prefill(joining)
            logits = new_logits if logits is None else torch.cat([logits, new_logits])
            self.metrics.running.set(len(self.batch))
        if logits is None:
            return
        tokens, failures = self.batch.sample(logits)
        logprobs = self.batch.logprobs(logits, tokens)
        now = time.perf_counter()
        for job in joining:
            job.first_token_at = now
            self.metrics.time_to_first_token.observe(now - job.submitted_at)
            self.metrics.prefill_time.observe(now - job.admitted_at)
        deliveries, ending = self._advance(tokens.tolist(), logprobs, failures, now)

        if decoding:
            self.metrics.inter_token_latency.observe(now - self._last_step)
        self._last_step = now
        # Last, so that a client which has its final token also sees the metrics and the row
        # freed.
        self._outbox.extend(deliveries)
        if joining or ending or now - self._last_delivery >= self.stream_interval:
            self._deliver([])

    def _admit(self) -> list[Job]:
        """Move waiting jobs into free rows; score prompts that asked for it."""
        joining: list[Job] = []
        self._admitted = []
        while self._waiting and len(joining) < self.batch.free:
            job = self._waiting.popleft()
            job.stage = Stage.RUNNING
            job.admitted_at = time.perf_counter()
            self._admitted.append(job)
            self.metrics.waiting.dec()
            self.metrics.queue_time.observe(job.admitted_at - job.submitted_at)
            self.metrics.prompt_tokens.inc(len(job.prompt_ids))
            self.metrics.request_prompt_tokens.observe(len(job.prompt_ids))
            if job.state is None:  # only the prompt to score
                scores = self._score(job)
                now = time.perf_counter()
                self.metrics.finish("length", job.submitted_at, now, now, generated=0)
                self._release(job)  # before the reply, so its reader finds the engine done
                self._deliver([(job.events, scores)])
                continue
            if job.score_prompt:
                self._deliver([(job.events, self._score(job))])
            joining.append(job)
        return joining

    def _score(self, job: Job) -> PromptScores:
        chosen, values, ids = self.batch.score(job.prompt_ids, job.logprobs or 0)
        return PromptScores(chosen.tolist(), ids.tolist(), values.tolist())

    def _advance(
        self,
        tokens: list[int],
        logprobs: StepLogprobs | None,
        failures: dict[int, FailureReason],
        now: float,
    ) -> tuple[Delivery, bool]:
        """Hand each row's token to its job; fail the rows that could not be sampled; let
        finished jobs leave; return the events and whether any job left."""
        members = self.batch.members
        events: list[tuple[asyncio.Queue, Event] | None] = []  # per row; None: failed row
        leaving: list[Job] = []
        for row, (job, token) in enumerate(zip(members, tokens, strict=True)):
            if row in failures:
                events.append(None)
                leaving.append(job)
                continue
            state = job.state
            assert state is not None
            text = state.append(token)
            events.append((job.events, TokenEvent(token, text, state.finish_reason)))
            if state.finish_reason is not None:
                leaving.append(job)
                generated = len(state.generated_ids)
                self.metrics.finish(
                    state.finish_reason, job.submitted_at, job.first_token_at, now, generated
                )
        if logprobs is not None:
            for row, chosen, values, ids in zip(*logprobs, strict=True):
                if (delivery := events[row]) is not None:
                    top = members[row].logprobs
                    event = delivery[1]._replace(
                        logprob=chosen, top_ids=ids[:top], top_values=values[:top]
                    )
                    events[row] = (delivery[0], event)
        deliveries = [delivery for delivery in events if delivery is not None]
        self.metrics.generation_tokens.inc(len(deliveries))
        for row, reason in failures.items():
            logger.error("model '%s': request failed alone: %s", self.name, reason)
            self.metrics.failures[reason].inc()
            error = APIError(500, SAMPLING_FAILURES[reason], code="sampling_failed")
            deliveries.append((members[row].events, Failure(error)))
        if leaving:
            self.batch.remove(leaving)
            self.metrics.running.set(len(self.batch))
            for job in leaving:
                self._release(job)
        return deliveries, bool(leaving)

    def _fail(self, jobs: list[Job], error: APIError) -> None:
        for job in jobs:
            if job.stage == Stage.QUEUED:
                self.metrics.waiting.dec()
            self._release(job)
        self.metrics.running.set(len(self.batch))
        self._deliver([(job.events, Failure(error)) for job in jobs])

    def _deliver(self, deliveries: Delivery) -> None:
        """Send the waiting token events, then ``deliveries``, in one wake-up of the loop."""
        deliveries, self._outbox = [*self._outbox, *deliveries], []
        if not deliveries or self._loop is None:
            return
        self._last_delivery = time.perf_counter()
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self._loop.call_soon_threadsafe(_put_all, deliveries)
