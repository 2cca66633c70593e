"""The pure scheduler's decisions on scripted arrivals: no model, thread or process."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import pytest

from server.engine.scheduler import Phase, Scheduler, StepPlan


@dataclass(eq=False)
class Ask:
    """A scripted request: a prompt of ``prompt_length`` tokens, generating unless scoring."""

    prompt_length: int
    needs_row: bool = True
    name: str = ""


def plan_of(plan: StepPlan[Ask]) -> list[tuple[str, int]]:
    return [(request.name, count) for request, count in plan.prefill]


def asks(*lengths: int) -> list[Ask]:
    return [Ask(length, name=f"r{i}") for i, length in enumerate(lengths)]


def test_arrivals_take_free_rows_in_order_and_the_rest_wait() -> None:
    scheduler: Scheduler[Ask] = Scheduler(max_rows=2, prefill_chunk=100)
    first, second, third = asks(5, 6, 7)
    for request in (first, second, third):
        scheduler.add(request)
    plan = scheduler.schedule()
    assert plan_of(plan) == [("r0", 5), ("r1", 6)]
    assert plan.admitted == [first, second]
    assert [scheduler.phase(r) for r in (first, second, third)] == [
        Phase.DECODING,
        Phase.DECODING,
        Phase.WAITING,
    ]
    assert plan_of(scheduler.schedule()) == []  # no row free: the third keeps waiting
    scheduler.finish([first])
    assert plan_of(scheduler.schedule()) == [("r2", 7)]  # the freed row, at the next step
    assert scheduler.phase(first) == Phase.GONE


def test_decoding_rows_and_prompt_tokens_share_the_step_budget() -> None:
    """vLLM's token budget: each decoding row takes one token of the step's, prompts the rest;
    a prompt that fits what a step leaves prompts but not what is left of it waits whole, one
    longer than that is prefilled in chunks."""
    scheduler: Scheduler[Ask] = Scheduler(max_rows=8, prefill_chunk=10)
    for request in asks(4, 4, 4, 8, 9):
        scheduler.add(request)
    plan = scheduler.schedule()  # r2 fits 10, not the 2 left
    assert (plan_of(plan), plan.decoding) == ([("r0", 4), ("r1", 4)], 0)
    plan = scheduler.schedule()  # 2 decode: 8 for prompts; r3 (8) fits them, not the 4 left
    assert (plan_of(plan), plan.decoding) == ([("r2", 4)], 2)
    plan = scheduler.schedule()  # 3 decode: 7 for prompts, fewer than r3's 8
    assert (plan_of(plan), plan.decoding) == ([("r3", 7)], 3)
    plan = scheduler.schedule()
    assert (plan_of(plan), plan.decoding) == ([("r3", 1), ("r4", 6)], 3)  # r4 (9): chunked
    plan = scheduler.schedule()
    assert (plan_of(plan), plan.decoding) == ([("r4", 3)], 4)
    assert scheduler.schedule().decoding == 5


def test_a_burst_of_short_prompts_joins_in_one_step() -> None:
    scheduler: Scheduler[Ask] = Scheduler(max_rows=64, prefill_chunk=2048)
    burst = asks(*[32] * 64)
    for request in burst:
        scheduler.add(request)
    plan = scheduler.schedule()
    assert plan.admitted == burst and plan_of(plan) == [(r.name, 32) for r in burst]
    assert scheduler.schedule().decoding == 64


def test_decoding_rows_never_starve_a_waiting_prompt() -> None:
    scheduler: Scheduler[Ask] = Scheduler(max_rows=4, prefill_chunk=3)
    for request in asks(1, 1, 1, 2):
        scheduler.add(request)
    assert plan_of(scheduler.schedule()) == [("r0", 1), ("r1", 1), ("r2", 1)]
    assert plan_of(scheduler.schedule()) == [("r3", 1)]  # 3 rows decode: one token is left
    assert plan_of(scheduler.schedule()) == [("r3", 1)]


def test_tokens_held_by_the_prefix_cache_cost_no_budget() -> None:
    cached = {"long": 32, "whole": 40}
    scheduler: Scheduler[Ask] = Scheduler(
        max_rows=4, prefill_chunk=10, cached=lambda request: cached.get(request.name, 0)
    )
    long, whole, short = Ask(40, name="long"), Ask(40, name="whole"), Ask(5, name="short")
    for request in (long, whole, short):
        scheduler.add(request)
    plan = scheduler.schedule()
    # the last token of a prompt is always fed (its logits are the first draw)
    assert plan_of(plan) == [("long", 8), ("whole", 1)]
    assert plan.reused == {id(long): 32, id(whole): 39}
    assert scheduler.phase(long) == scheduler.phase(whole) == Phase.DECODING
    plan = scheduler.schedule()  # 2 decode: short fits the 8 left now
    assert (plan_of(plan), plan.reused) == ([("short", 5)], {})


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks_first() -> None:
    scheduler: Scheduler[Ask] = Scheduler(max_rows=8, prefill_chunk=10)
    short, long, late = asks(3, 25, 2)
    for request in (short, long, late):
        scheduler.add(request)
    assert plan_of(scheduler.schedule()) == [("r0", 3), ("r1", 7)]  # the rest of the budget
    assert scheduler.phase(long) == Phase.PREFILLING
    assert plan_of(scheduler.schedule()) == [("r1", 9)]  # nobody overtakes it; r0 takes one
    assert plan_of(scheduler.schedule()) == [("r1", 9)]  # done, and the budget with it
    assert scheduler.phase(long) == Phase.DECODING
    assert plan_of(scheduler.schedule()) == [("r2", 2)]  # the next joins


def test_a_scoring_request_takes_budget_but_no_row() -> None:
    scheduler: Scheduler[Ask] = Scheduler(max_rows=1, prefill_chunk=10)
    busy, score, big_score, after = Ask(4, name="busy"), Ask(5, False), Ask(30, False), Ask(1)
    for request in (busy, score, big_score, after):
        scheduler.add(request)
    plan = scheduler.schedule()
    assert plan_of(plan) == [("busy", 4)] and plan.scored == [score]
    assert plan.admitted == [busy, score]
    plan = scheduler.schedule()  # a prompt past the budget is scored whole, alone in a step
    assert plan.scored == [big_score] and plan.prefill == []
    assert scheduler.schedule().admitted == []  # `after` needs a row, and `busy` holds it
    assert scheduler.phase(big_score) == Phase.GONE


def test_cancelling_frees_the_row_or_the_place_in_the_queue() -> None:
    scheduler: Scheduler[Ask] = Scheduler(max_rows=1, prefill_chunk=4)
    running, waiting = asks(9, 2)
    scheduler.add(running)
    scheduler.add(waiting)
    scheduler.schedule()
    assert scheduler.cancel(waiting) == Phase.WAITING
    assert scheduler.cancel(running) == Phase.PREFILLING
    assert scheduler.cancel(running) == Phase.GONE
    assert scheduler.idle and scheduler.schedule().prefill == []


def test_a_failed_step_clears_the_rows_and_keeps_the_queue() -> None:
    scheduler: Scheduler[Ask] = Scheduler(max_rows=2, prefill_chunk=100)
    requests = asks(1, 2, 3)
    for request in requests:
        scheduler.add(request)
    scheduler.schedule()
    assert scheduler.clear_running() == requests[:2]
    assert plan_of(scheduler.schedule()) == [("r2", 3)]
    assert scheduler.clear() == [requests[2]] and scheduler.idle


@pytest.mark.parametrize("seed", range(5))
def test_random_arrivals_respect_rows_budget_order_and_finish_every_prompt(seed: int) -> None:
    """Scripted random traffic: no step exceeds the budget or the rows, requests start in
    arrival order, and every prompt is prefilled exactly once, in full."""
    rng = random.Random(seed)
    scheduler: Scheduler[Ask] = Scheduler(max_rows=3, prefill_chunk=16)
    arrivals = [Ask(rng.randint(1, 40), rng.random() > 0.2, f"r{i}") for i in range(30)]
    pending, started, fed = list(arrivals), [], {id(a): 0 for a in arrivals}
    decoding: dict[int, int] = {}  # id → steps left to decode
    while pending or not scheduler.idle:
        for _ in range(rng.randint(0, 3)):
            if pending:
                scheduler.add(pending.pop(0))
        decoding_rows = sum(1 for r in scheduler.running if id(r) in decoding)
        plan = scheduler.schedule()
        assert plan.decoding == decoding_rows
        prompt_tokens = sum(count for _, count in plan.prefill)
        scored = sum(r.prompt_length for r in plan.scored)
        # decoding rows and prompts within the budget (a prompt always gets a token; a scored
        # prompt past the budget is scored alone beside the decoding rows)
        total = prompt_tokens + scored + plan.decoding
        assert total <= max(16, decoding_rows + 1, scored + plan.decoding)
        assert len(scheduler.running) <= 3
        started += plan.admitted
        for request, count in plan.prefill:
            fed[id(request)] += count
            assert fed[id(request)] <= request.prompt_length
            if fed[id(request)] == request.prompt_length:
                decoding[id(request)] = rng.randint(1, 4)
        for request in plan.scored:
            fed[id(request)] = request.prompt_length
        done = [r for r in scheduler.running if decoding.get(id(r), 1) <= 0]
        scheduler.finish(done)
        for request in scheduler.running:
            if id(request) in decoding:
                decoding[id(request)] -= 1
    assert started == arrivals
    assert all(fed[id(a)] == a.prompt_length for a in arrivals)


def test_a_lower_priority_is_admitted_before_every_queued_higher_one() -> None:
    """vLLM's polarity: with the rows full and requests queued, a priority -1 arrival is
    admitted before every waiting priority 0 one; arrival order holds among equals."""
    scheduler: Scheduler[Ask] = Scheduler(max_rows=1, prefill_chunk=100)
    holder, *queued = asks(3, 4, 5, 6)
    urgent, later = Ask(2, name="urgent"), Ask(2, name="later")
    scheduler.add(holder)
    assert plan_of(scheduler.schedule()) == [("r0", 3)]  # the only row
    for request in queued:
        scheduler.add(request)
    scheduler.add(urgent, priority=-1)
    scheduler.add(later, priority=5)
    assert list(scheduler.waiting) == [urgent, *queued, later]
    order = []
    for running in [holder, urgent, *queued]:
        scheduler.finish([running])
        order.extend(name for name, _ in plan_of(scheduler.schedule()))
    assert order == ["urgent", "r1", "r2", "r3", "later"]
    assert scheduler.idle is False and scheduler.cancel(later) == Phase.DECODING


def test_cancelling_a_queued_request_forgets_its_priority() -> None:
    scheduler: Scheduler[Ask] = Scheduler(max_rows=1, prefill_chunk=100)
    first, second = asks(3, 3)
    scheduler.add(first, priority=2)
    scheduler.add(second, priority=1)
    assert scheduler.cancel(first) == Phase.WAITING
    assert scheduler.cancel(first) == Phase.GONE
    assert plan_of(scheduler.schedule()) == [("r1", 3)]
    assert scheduler.waiting == deque()


def test_aging_lets_a_waiting_request_pass_later_more_urgent_arrivals() -> None:
    """With aging 1 s, a priority 0 request that has waited goes before every -1 arriving
    over 1 s after it, and after those arriving sooner; without aging, after all of them."""
    for aging, expected in [
        (1.0, ["early", "waiter", "late", "later"]),
        (0.0, ["early", "late", "later", "waiter"]),
    ]:
        scheduler: Scheduler[Ask] = Scheduler(max_rows=1, prefill_chunk=100, aging=aging)
        holder = Ask(3, name="holder")
        scheduler.add(holder, arrived=100.0)
        scheduler.schedule()
        waiter, early, late, later = (Ask(2, name=n) for n in ["waiter", "early", "late", "later"])
        scheduler.add(waiter, priority=0, arrived=100.0)
        scheduler.add(early, priority=-1, arrived=100.5)  # 0.5 s after: still ahead of it
        scheduler.add(late, priority=-1, arrived=101.5)  # 1.5 s after: behind it
        scheduler.add(later, priority=-1, arrived=109.0)
        order, running = [], holder
        while not scheduler.idle:
            scheduler.finish([running])
            (running, _), *_ = scheduler.schedule().prefill
            order.append(running.name)
            if len(order) == 4:
                scheduler.finish([running])
        assert order == expected, aging


def test_aging_bounds_the_wait_under_a_flood_of_more_urgent_requests() -> None:
    """Issue 55's flood, scripted: two rows, six clients each sending a priority -1 request of
    0.3 s as soon as their last one ends, for a minute. A priority 0 request arriving at 1 s is
    never admitted without aging; with aging it waits ``aging`` s for each level it lacks, then
    for the two -1s running and the four queued by then (three rounds of 0.3 s at most): every
    later -1 goes after it."""

    def admitted_at(aging: float, priority: int = 0) -> float | None:
        scheduler: Scheduler[Ask] = Scheduler(max_rows=2, prefill_chunk=100, aging=aging)
        waiter = Ask(1, name="waiter")
        ends: dict[int, float] = {}  # id(running request) → when it ends
        for client in range(6):
            scheduler.add(Ask(1, name=f"client{client}"), priority=-1, arrived=0.0)
        for tick in range(1200):
            now = tick / 20
            if tick == 20:
                scheduler.add(waiter, priority=priority, arrived=now)
            done = [r for r in scheduler.running if ends[id(r)] <= now]
            scheduler.finish(done)
            for request in done:  # its client sends the next one at once
                scheduler.add(Ask(1, name=request.name), priority=-1, arrived=now)
            for request in scheduler.schedule().admitted:
                if request is waiter:
                    return now
                ends[id(request)] = now + 0.3
        return None

    assert admitted_at(aging=0.0) is None  # starved for the whole minute
    for aging, levels in [(1.0, 1), (2.0, 1), (1.0, 4)]:
        waited = admitted_at(aging, priority=levels - 1)
        assert waited is not None
        assert 1.0 + levels * aging <= waited <= 1.0 + levels * aging + 3 * 0.3 + 0.05


def test_aging_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="aging"):
        Scheduler(max_rows=1, prefill_chunk=1, aging=-1.0)
