"""Who decodes next: admission, chunked prefill and finishing, as a pure object.

The :class:`Scheduler` holds no tensors, threads or clocks; it decides, and the engine carries
the decisions out on a ``model.decode.DecodeBatch``. Each step has a budget of tokens
(``prefill_chunk``) shared by decode and prefill, as vLLM's ``max_num_batched_tokens``: every
row already decoding takes one, and the rest goes to prompt tokens — first the rest of a prompt
already being prefilled, then new requests from the waiting queue in priority order (vLLM's
polarity: a lower ``priority`` is admitted sooner; arrival order among equals) while a batch
row is free and the budget lasts. So a burst of short prompts joins in one step, and a step
never holds more than the budget's tokens, however many streams decode. A prompt that fits
what is left is prefilled whole; a prompt longer than the step's whole prompt budget is
prefilled in chunks over several steps (the rows already decoding take a step between
chunks); one that fits the step's budget but not what is left of it waits for the next step.
The prompt budget is at least one token, so a waiting prompt is never starved by decoding rows.
A request that only scores its prompt (``needs_row`` False) takes no row.

With ``aging`` (seconds), a waiting request's priority improves by one for every ``aging``
seconds it has waited, so that a stream of more urgent arrivals holds a request back for a
bounded time: a ``priority: 0`` request is admitted before every ``-1`` that arrives more than
``aging`` s after it. Every waiting request ages at the same rate, so the order of the queue
never changes while it waits: a request is placed once, when it arrives, by ``priority +
arrived / aging`` (``arrived``: its arrival on the caller's clock, the same for every
request). Without aging (0, vLLM's strict policy) it is placed by ``priority`` alone.

With ``cached`` (the engine's prefix cache), a request's first ``cached(request)`` prompt
tokens are reused rather than prefilled: asked when a row is free for it (the cache may have
changed while it waited), they cost no budget, and ``StepPlan.reused`` says how many the engine
must copy into its row.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, Protocol, TypeVar


class Schedulable(Protocol):
    """What the scheduler reads of a request."""

    @property
    def prompt_length(self) -> int: ...

    @property
    def needs_row(self) -> bool: ...


R = TypeVar("R", bound=Schedulable)


class Phase(Enum):
    """Where a request is, as the scheduler sees it."""

    WAITING = "waiting"  # queued for a row
    PREFILLING = "prefilling"  # holds a row; part of its prompt is not prefilled yet
    DECODING = "decoding"  # holds a row; its whole prompt is prefilled
    GONE = "gone"  # finished, cancelled or never seen: it holds nothing


@dataclass
class StepPlan(Generic[R]):
    """One step's decisions. ``prefill``: (request, prompt tokens to prefill now), the request
    being prefilled first, then the newly admitted ones in arrival order; ``admitted``: the
    requests taken from the queue this step (``scored`` those that only score their prompt:
    they are done once scored); ``reused``: admitted request → its first prompt tokens taken
    from the prefix cache (only those with some), which its chunk starts after; ``decoding``:
    the rows that decode this step, each one token of the budget."""

    prefill: list[tuple[R, int]] = field(default_factory=list)
    admitted: list[R] = field(default_factory=list)
    scored: list[R] = field(default_factory=list)
    reused: dict[int, int] = field(default_factory=dict)  # id(request) → tokens
    decoding: int = 0


class Scheduler(Generic[R]):
    """Admission by priority, then arrival, into ``max_rows`` rows, at most ``prefill_chunk``
    tokens a step (decoding rows and prompt tokens together). A request already holding a row
    keeps it (no preemption). ``cached``: how many of a request's first prompt tokens need no
    prefill (None: none ever). ``aging``: seconds of waiting worth one level of priority (0:
    none)."""

    def __init__(
        self,
        max_rows: int,
        prefill_chunk: int,
        cached: Callable[[R], int] | None = None,
        aging: float = 0.0,
    ) -> None:
        if max_rows < 1 or prefill_chunk < 1:
            raise ValueError(f"max_rows and prefill_chunk must be ≥ 1: {max_rows}, {prefill_chunk}")
        if not aging >= 0:
            raise ValueError(f"aging must be ≥ 0 seconds: {aging}")
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk
        self.cached = cached
        self.aging = aging
        self.waiting: deque[R] = deque()
        self.running: list[R] = []  # holding a row, in admission order
        self._prefilled: dict[int, int] = {}  # id(request) → prompt tokens planned so far
        self._rank: dict[int, float] = {}  # id(request) → its place in the queue, while it waits

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, request: R, priority: int = 0, arrived: float = 0.0) -> None:
        """Queue ``request`` behind every waiting request of its rank or a lower one, ahead of
        those of a higher one. Its rank is ``priority + arrived / aging`` (``priority`` without
        aging), ``arrived`` in seconds on the caller's clock, the same for every request."""
        rank = priority + arrived / self.aging if self.aging else float(priority)
        self._rank[id(request)] = rank
        behind = sum(1 for other in self.waiting if self._rank[id(other)] <= rank)
        # the waiting queue is kept sorted, so those are exactly the first ``behind``
        self.waiting.insert(behind, request)

    def _admit(self) -> R:
        request = self.waiting.popleft()
        del self._rank[id(request)]
        return request

    def phase(self, request: R) -> Phase:
        if request in self.running:
            done = self._prefilled[id(request)] == request.prompt_length
            return Phase.DECODING if done else Phase.PREFILLING
        return Phase.WAITING if request in self.waiting else Phase.GONE

    def cancel(self, request: R) -> Phase:
        """Forget ``request`` wherever it is; returns where it was."""
        phase = self.phase(request)
        if phase == Phase.WAITING:
            self.waiting.remove(request)
            del self._rank[id(request)]
        elif phase != Phase.GONE:
            self.finish([request])
        return phase

    def finish(self, requests: list[R]) -> None:
        """``requests`` leave their rows (finished or failed)."""
        for request in requests:
            self.running.remove(request)
            del self._prefilled[id(request)]

    def clear_running(self) -> list[R]:
        """Every request holding a row leaves (their step failed); returns them."""
        running, self.running = self.running, []
        self._prefilled.clear()
        return running

    def clear(self) -> list[R]:
        """Everything leaves (shutdown): the running requests, then the waiting ones."""
        everyone = [*self.clear_running(), *self.waiting]
        self.waiting.clear()
        self._rank.clear()
        return everyone

    def schedule(self) -> StepPlan[R]:
        """Decide the next step, and count its prompt tokens as prefilled."""
        plan: StepPlan[R] = StepPlan()
        plan.decoding = sum(1 for r in self.running if not self._left(r))
        step_budget = max(1, self.prefill_chunk - plan.decoding)  # what prompts may take
        budget = step_budget
        partial = next((r for r in self.running if self._left(r)), None)
        if partial is not None:
            budget -= self._take(plan, partial, budget)
            partial = partial if self._left(partial) else None
        while self.waiting and budget > 0 and partial is None:
            request = self.waiting[0]
            if not request.needs_row:
                length = request.prompt_length
                if not (length <= budget or budget == step_budget):
                    break
                plan.scored.append(self._admit())
                plan.admitted.append(request)
                budget -= min(length, budget)
                continue
            if len(self.running) >= self.max_rows:
                break
            reused = self.cached(request) if self.cached is not None else 0
            reused = max(0, min(reused, request.prompt_length - 1))  # the last token is fed
            length = request.prompt_length - reused
            if not (length <= budget or length > step_budget):
                break
            self.running.append(self._admit())
            self._prefilled[id(request)] = reused
            if reused:
                plan.reused[id(request)] = reused
            plan.admitted.append(request)
            budget -= self._take(plan, request, budget)
            partial = request if self._left(request) else None
        return plan

    def _left(self, request: R) -> int:
        return request.prompt_length - self._prefilled[id(request)]

    def _take(self, plan: StepPlan[R], request: R, budget: int) -> int:
        """Plan up to ``budget`` more of ``request``'s prompt; returns the tokens planned."""
        count = min(self._left(request), budget)
        plan.prefill.append((request, count))
        self._prefilled[id(request)] += count
        return count
