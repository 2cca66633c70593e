"""One model's engine, inside the engine process: a Scheduler decides, a DecodeBatch computes.

:meth:`ModelEngine.step`:

0. a job with a structured-output constraint waits apart until its grammar is compiled, on a
   worker (``model.grammar``): it joins the scheduler's queue only then, so no step waits for a
   compile, and one that fails to compile ends with a 400 before it takes a row;
1. the scheduler (``server.engine.scheduler``, pure) plans the step: which prompt chunks to prefill,
   which waiting jobs to admit; each admitted job takes its batch row, and the keys and values
   of its prompt's first tokens are copied there from the model's prefix cache
   (``model.prefix_cache``) when a recent prompt began with them;
2. prompts that asked for their logprobs are scored (one full forward each);
3. ``DecodeBatch.step`` runs the cached decode forward, the ragged prefill forward and one
   sampling call (``model.decode``, the same core as offline ``generate()``);
4. each sampled token goes to its job's ``SequenceState`` (text, stop strings, token budget),
   and the step's events leave at once (``Outbox.flush``: a first token does not wait for
   the bookkeeping that follows);
5. the prompts completed this step are kept in the prefix cache (their full blocks);
   finished and failed jobs leave their rows.

Events and metric changes go to an :class:`Outbox`, which the process loop (``server.engine.core``)
sends to the API process. A row that cannot be sampled fails alone (one whose grammar fails or
passes its budget too: a 400 naming why); a step that raises fails the jobs in it (500), never
the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from model.decode import DecodeBatch, Row, Sampled, Tokens
from model.generate import SequenceState, StopMatcher
from model.grammar import GrammarError, GrammarMatcher, constraint_of
from model.prefix_cache import PrefixCache, block_digests
from model.sampling import RowSampler
from model.sampling_params import FailureReason
from model.speculative import Speculation, refusal
from model.tokenizer import IncrementalDecoder
from server.engine.loader import LoadedModel
from server.engine.scheduler import Phase, Scheduler
from server.messages import (
    MODEL_ERROR,
    SHUTDOWN,
    Dropped,
    EngineConfig,
    Event,
    Failed,
    Finish,
    ModelStats,
    Outputs,
    Scores,
    Submit,
    Token,
)

logger = logging.getLogger("ordinal.engine")

SAMPLING_FAILURES = {
    FailureReason.NON_FINITE_LOGITS: "sampling failed for this request: the model's logits "
    "for it were not finite (the other requests in its batch were not affected)",
    FailureReason.SAMPLING_ERROR: "sampling failed for this request (the other requests in "
    "its batch were not affected)",
    FailureReason.GRAMMAR_FAILED: "structured output failed for this request: {why} (the "
    "other requests in its batch were not affected)",
}
SHUTTING_DOWN = "the server is shutting down"
# An idle model's KV cache shrinks back after this many seconds without a step, not at once:
# the next request would otherwise pay for allocating (and zeroing) it again (~1 ms).
IDLE_SHRINK = 2.0


@dataclass(eq=False, kw_only=True)
class Request(Row):
    """One job in the engine: its batch row (``tokens`` is ``state`` when it generates) and
    what the engine reports about it. ``done`` once its terminal event has been sent."""

    submit: Submit
    state: SequenceState | None  # None: it only scores its prompt
    admitted_at: float = 0.0
    first_token_at: float = 0.0
    done: bool = False
    digests: list[bytes] = field(default_factory=list)  # its prompt's blocks (prefix cache)
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache, not prefilled

    @property
    def id(self) -> int:
        return self.submit.id

    @property
    def prompt_length(self) -> int:
        return len(self.submit.prompt_ids)

    @property
    def needs_row(self) -> bool:
        return self.state is not None


class Outbox:
    """What the engine process sends next: events in order, and each model's stats.

    ``send`` (the process loop's) sends what must not wait; :meth:`flush` calls it."""

    def __init__(self, send: Callable[[], None] | None = None) -> None:
        self.events: list[Event] = []
        self.stats: dict[str, ModelStats] = {}
        # The jobs with an event that must not wait: a first or last token, a failure.
        self.urgent_jobs: set[int] = set()
        self._send = send

    @property
    def urgent(self) -> bool:
        return bool(self.urgent_jobs)

    def flush(self) -> None:
        """Send now what must not wait (nothing without a ``send``: the caller takes it)."""
        if self._send is not None and self.urgent_jobs:
            self._send()

    def add(self, event: Event, urgent: bool = False) -> None:
        self.events.append(event)
        if urgent:
            self.urgent_jobs.add(event.id)

    def extend(self, events: list[Token], urgent_jobs: set[int]) -> None:
        """A step's tokens, in row order; ``urgent_jobs``: the jobs whose first or last token
        is among them."""
        self.events += events
        self.urgent_jobs |= urgent_jobs

    def stats_of(self, model: str, running: int, waiting: int) -> ModelStats:
        """``model``'s stats for the next frame, its gauges set to ``running``, ``waiting``."""
        stats = self.stats.get(model)
        if stats is None:
            stats = self.stats[model] = ModelStats(model, running, waiting)
        stats.running, stats.waiting = running, waiting
        return stats

    def take(self, everything: bool = True) -> Outputs | None:
        """The next frame (None: nothing to send). ``everything`` False: only the urgent jobs'
        events, each job's in order (ordinary tokens it had waiting included), and the stats;
        the other jobs' tokens wait on. A job's first token then travels in a frame of its own
        instead of taking every stream's waiting tokens along: at 32 streams such frames
        came every ~5 ms, and the interval's batching was mostly lost (docs/performance-log.md,
        fourteenth round)."""
        if not self.events and not self.stats:
            return None
        events = self.events
        waiting: list[Event] = []
        if not everything:
            events = []
            for event in self.events:
                (events if event.id in self.urgent_jobs else waiting).append(event)
        self.events = waiting
        outputs = Outputs(events, list(self.stats.values()))
        self.stats, self.urgent_jobs = {}, set()
        return outputs


def speculation_of(config: EngineConfig) -> Speculation | None:
    """How the server's rows speculate (``--speculative``), or None."""
    if config.speculative is None:
        return None
    return Speculation(
        config.num_speculative_tokens,
        config.prompt_lookup_max,
        config.prompt_lookup_min,
        config.speculative,
    )


class ModelEngine:
    """The jobs of one loaded model: a scheduler and a batch of ``max_rows`` rows."""

    def __init__(
        self,
        loaded: LoadedModel,
        max_rows: int,
        prefill_chunk: int,
        outbox: Outbox,
        prefix_cache_tokens: int = 0,
        cuda_graphs: bool = True,
        priority_aging: float = 0.0,
        speculation: Speculation | None = None,
    ) -> None:
        """``prefix_cache_tokens``: the most prompt tokens whose keys and values are kept for
        reuse (0: no prefix cache; none either for a scheme that is not ``prefix_stable``).
        ``cuda_graphs``: False decodes every step eagerly on a GPU too (``model.captured``).
        ``priority_aging``: seconds of waiting worth one level of priority (the scheduler's).
        ``speculation``: rows speculate (``model.speculative``), where the model verifies
        exactly; ``speculative`` says how, or why not (``ModelInfo.speculative``)."""
        self.loaded = loaded
        self.name = loaded.name
        self.speculative: str | None = None
        if speculation is not None:
            why = refusal(loaded.model)
            if why is None:
                self.speculative = f"{speculation.method}, up to {speculation.tokens} tokens"
            else:
                self.speculative = f"off: {why}"
                logger.info("model '%s': speculative decoding off: %s", self.name, why)
                speculation = None
        self.batch: DecodeBatch[Request] = DecodeBatch(
            loaded.model,
            max_rows,
            loaded.max_context,
            loaded.vocab,
            loaded.bos,
            grow=True,
            graphs=None if cuda_graphs else False,  # None: on a GPU (model.captured.wanted)
            speculation=speculation,
        )
        self.prefix: PrefixCache | None = None
        if prefix_cache_tokens and loaded.model.positional.prefix_stable:
            cache = self.batch.cache
            self.prefix = PrefixCache(
                loaded.model.config, prefix_cache_tokens, cache.keys.device, cache.keys.dtype
            )
        reusable = self._reusable if self.prefix is not None else None
        self.scheduler: Scheduler[Request] = Scheduler(
            max_rows, prefill_chunk, reusable, priority_aging
        )
        self.requests: dict[int, Request] = {}  # every job not yet ended, by id
        # jobs whose grammar is compiling, with it, their priority and their submission time:
        # not yet queued
        self.compiling: dict[int, tuple[Request, GrammarMatcher, int, float]] = {}
        self.outbox = outbox
        self._last_step = 0.0

    @property
    def idle(self) -> bool:
        """Nothing to step (jobs whose grammar is compiling wait apart: see take_compiled)."""
        return self.scheduler.idle

    @property
    def shrink_due(self) -> float | None:
        """When this idle model's KV cache growth is due back (None: working, or none)."""
        if not self.idle or not self.batch.cache.grown:
            return None
        return self._last_step + IDLE_SHRINK

    def shrink_if_due(self, now: float) -> None:
        due = self.shrink_due
        if due is not None and now >= due:
            self.batch.shrink()

    def stats(self) -> ModelStats:
        running = len(self.scheduler.running)
        waiting = len(self.scheduler.waiting) + len(self.compiling)
        stats = self.outbox.stats_of(self.name, running, waiting)
        stats.kv_cache_usage = self.batch.cache.usage
        return stats

    def submit(self, submit: Submit) -> None:
        state = None
        if submit.max_tokens > 0:
            state = SequenceState(
                prompt_ids=submit.prompt_ids,
                max_new_tokens=submit.max_tokens,
                decoder=IncrementalDecoder(self.loaded.tokenizer, self.loaded.token_bytes),
                stop=StopMatcher(submit.stop),
                eos_id=submit.eos_id,
            )
        constraint = constraint_of(submit.params, self.loaded.tokenizer, self.loaded.eos)
        request = Request(
            tokens=state or Tokens(submit.prompt_ids, []),
            sampler=RowSampler(submit.params, constraint),
            logprobs=submit.logprobs,
            max_new_tokens=submit.max_tokens,
            submit=submit,
            state=state,
        )
        if self.prefix is not None and state is not None:
            request.digests = block_digests(submit.prompt_ids, self.prefix.block)
        self.requests[request.id] = request
        if constraint is None:
            self.scheduler.add(request, submit.priority, submit.submitted_at)
        else:
            self.compiling[request.id] = (
                request,
                constraint,
                submit.priority,
                submit.submitted_at,
            )
            self.take_compiled()
        self.stats()

    def take_compiled(self) -> None:
        """Queue the jobs whose grammar has compiled; end those whose grammar failed to (400).
        Called every turn of the process loop while any compile (``compiling``)."""
        for job, (request, constraint, priority, submitted_at) in list(self.compiling.items()):
            if not constraint.ready:
                continue
            del self.compiling[job]
            try:
                constraint.check()
            except GrammarError as error:
                failures = self.stats().failures
                reason = FailureReason.GRAMMAR_FAILED
                failures[reason] = failures.get(reason, 0) + 1
                self._end(request, Failed(job, 400, f"structured output: {error}", reason.value))
                continue
            self.scheduler.add(request, priority, submitted_at)

    def cancel(self, job: int) -> None:
        """Drop job ``job`` wherever it is (nothing if it has already ended)."""
        request = self.requests.get(job)
        if request is None:
            return
        self.compiling.pop(job, None)
        phase = self.scheduler.cancel(request)
        if phase in (Phase.PREFILLING, Phase.DECODING):
            self.batch.remove([request])
        self.stats().finished.append(Finish("abort"))
        self._end(request, Dropped(request.id))

    def step(self) -> None:
        """One step; a step that raises fails its jobs, and the engine carries on."""
        admitted: list[Request] = []
        try:
            self._step(admitted)
        except Exception:
            logger.exception("model '%s': decode step failed", self.name)
            self.batch.clear()
            failing = self.scheduler.clear_running()
            failing += [r for r in admitted if r not in failing]
            failing = [r for r in failing if not r.done]  # not those whose end has been sent
            failures = self.stats().failures
            failures[MODEL_ERROR] = failures.get(MODEL_ERROR, 0) + len(failing)
            for request in failing:
                self._end(request, Failed(request.id, 500, "the model failed on this batch"))

    def shutdown(self) -> None:
        """Fail every job left (503): the server is stopping."""
        leftover = self.scheduler.clear() + [request for request, *_ in self.compiling.values()]
        self.compiling.clear()
        self.batch.clear()
        if leftover:
            failures = self.stats().failures
            failures[SHUTDOWN] = failures.get(SHUTDOWN, 0) + len(leftover)
        for request in leftover:
            self._end(request, Failed(request.id, 503, SHUTTING_DOWN))

    def _reusable(self, request: Request) -> int:
        """How many of ``request``'s first prompt tokens the prefix cache holds."""
        assert self.prefix is not None  # the scheduler asks only when there is one
        return self.prefix.match(request.digests, request.prompt_length)

    def _step(self, admitted: list[Request]) -> None:
        plan = self.scheduler.schedule()
        admitted += plan.admitted
        now = time.monotonic()
        for request in plan.admitted:
            self._admit(request, now)
            if request.state is not None:
                self._join(request, plan.reused.get(id(request), 0))
        for request in plan.admitted:
            if request.state is None or request.submit.score_prompt:
                self._score(request)
        decoding = bool(self.batch.decoding)
        sampled = self.batch.step([(request, count) for request, count in plan.prefill])
        now = time.monotonic()
        stats = self.stats()
        if decoding:
            stats.inter_token.append(now - self._last_step)
        self._last_step = now
        leaving = self._advance(sampled, now, stats) if sampled is not None else []
        self.outbox.flush()
        if self.prefix is not None:  # before the leaving rows give their slots up
            self._keep_prompts(plan.prefill)
        self._leave(leaving)

    def _admit(self, request: Request, now: float) -> None:
        request.admitted_at = now
        stats = self.stats()
        stats.queue_times.append(now - request.submit.submitted_at)
        stats.prompt_tokens.append(request.prompt_length)

    def _join(self, request: Request, reused: int) -> None:
        """``request`` takes its batch row, its first ``reused`` prompt tokens copied there."""
        row = self.batch.join(request)
        if self.prefix is None:
            return
        stats = self.stats()
        stats.prefix_queries += request.prompt_length
        if reused:
            self.prefix.load(request.digests, reused, self.batch.cache, row)
            request.cached_tokens = reused
            stats.prefix_hits += reused

    def _keep_prompts(self, prefilled: list[tuple[Request, int]]) -> None:
        """Keep the blocks of every prompt that this step's prefill completed."""
        assert self.prefix is not None
        lengths = self.batch.cache.lengths
        for request, _ in prefilled:
            row = request.index
            if request.digests and row is not None and int(lengths[row]) == request.prompt_length:
                self.prefix.store(request.digests, self.batch.cache, row)

    def _score(self, request: Request) -> None:
        """The prompt's logprobs; the job's last event when that is all it asked for."""
        chosen, values, ids = self.batch.score(request.submit.prompt_ids, request.logprobs or 0)
        scores = Scores(request.id, chosen.tolist(), ids.tolist(), values.tolist())
        if request.state is not None:
            self.outbox.add(scores, urgent=True)
            return
        e2e = time.monotonic() - request.submit.submitted_at
        self.stats().finished.append(Finish("length", e2e, 0.0, 0))
        self._end(request, scores)

    def _advance(self, sampled: Sampled, now: float, stats: ModelStats) -> list[Request]:
        """Hand each row's new tokens to its job (one, or more where its drafts were kept);
        fail the rows that could not be sampled; return the rows that leave (finished or
        failed). It runs once a row every step, so the loop keeps to what each row needs."""
        events: list[Token | None] = []  # each row's last event (None: it failed)
        tokens: list[Token] = []  # every event, in row order
        leaving: list[Request] = []
        urgent: set[int] = set()  # the jobs whose first or last token this is
        failures, accepted = sampled.failures, sampled.accepted
        for position, (row, token) in enumerate(zip(sampled.rows, sampled.tokens, strict=True)):
            if failures and position in failures:
                events.append(None)
                leaving.append(row)
                continue
            new = [*accepted[position], token] if accepted and position in accepted else [token]
            for each in new:  # its kept drafts, then its token, until one ends it
                tokens.append(self._token(row, each, now, stats, urgent))
                if tokens[-1].finish_reason is not None:
                    leaving.append(row)
                    break
            events.append(tokens[-1])
        self._add_logprobs(sampled, events)
        self.outbox.extend(tokens, urgent)
        stats.generation_tokens += len(tokens)
        if sampled.drafted:
            stats.spec_drafts += len(sampled.drafted)
            stats.spec_draft_tokens += sum(sampled.drafted.values())
            stats.spec_accepted_tokens += sum(len(kept) for kept in accepted.values())
        for position, reason in failures.items():
            row = sampled.rows[position]
            logger.error("model '%s': request failed alone: %s", self.name, reason)
            stats.failures[reason] = stats.failures.get(reason, 0) + 1
            self.outbox.add(self._sampling_failure(row, reason), urgent=True)
        for request in leaving:
            request.done = True  # its terminal event is in the outbox
        return leaving

    @staticmethod
    def _token(row: Request, token: int, now: float, stats: ModelStats, urgent: set[int]) -> Token:
        """``token`` appended to ``row``'s sequence, as the event that streams it."""
        state = row.state
        assert state is not None  # rows that only score never sample
        cached, queued = 0, 0.0
        if not row.first_token_at:
            row.first_token_at, cached = now, row.cached_tokens
            queued = row.admitted_at - row.submit.submitted_at
            urgent.add(row.id)
            ttft = now - row.submit.submitted_at
            stats.first_tokens.append((ttft, now - row.admitted_at))
        text = state.append(token, row.sampler.complete)
        reason = state.finish_reason
        if reason is not None:
            urgent.add(row.id)
            e2e, decode = now - row.submit.submitted_at, now - row.first_token_at
            stats.finished.append(Finish(reason, e2e, decode, len(state.generated_ids)))
        # the stop string reached: set once one ends it
        return Token(
            row.id,
            token,
            text,
            reason,
            cached_tokens=cached,
            queue_time=queued,
            stop=state.stop.matched,
        )

    @staticmethod
    def _sampling_failure(row: Request, reason: FailureReason) -> Failed:
        """The event that ends ``row``, which could not be sampled: its grammar's failure is
        the request's (400, saying why), the others the server's (500)."""
        message = SAMPLING_FAILURES[reason]
        if reason == FailureReason.GRAMMAR_FAILED:
            return Failed(row.id, 400, message.format(why=row.sampler.failure), "grammar_failed")
        return Failed(row.id, 500, message, "sampling_failed")

    def _leave(self, leaving: list[Request]) -> None:
        """``leaving`` give their rows up: their terminal events are sent or in the outbox."""
        if leaving:
            self.batch.remove(leaving)
            self.scheduler.finish(leaving)
            for request in leaving:
                del self.requests[request.id]
            self.stats()

    @staticmethod
    def _add_logprobs(sampled: Sampled, events: list[Token | None]) -> None:
        if sampled.logprobs is None:
            return
        for position, chosen, values, ids in zip(*sampled.logprobs, strict=True):
            event = events[position]
            if event is not None:
                top = sampled.rows[position].logprobs or 0
                event.logprob, event.top_ids, event.top_values = chosen, ids[:top], values[:top]

    def _end(self, request: Request, event: Event) -> None:
        """``request``'s terminal event: it leaves the engine's books."""
        request.done = True
        self.requests.pop(request.id, None)
        self.outbox.add(event, urgent=True)
        self.stats()
