"""The outbox sends a job's urgent events at once without taking the other jobs' waiting
tokens along, and never reorders a job's events."""

from __future__ import annotations

import time

from server.engine.core import EngineCore
from server.engine.engine import Outbox
from server.messages import Dropped, EngineConfig, Outputs, Token


def token(job: int, index: int, finish_reason: str | None = None) -> Token:
    return Token(job, index, f"{job}.{index}", finish_reason)


def texts(events: list) -> list[str]:
    return [event.text for event in events]


def test_an_urgent_frame_holds_the_urgent_jobs_events_in_order_and_no_others() -> None:
    outbox = Outbox()
    outbox.extend([token(1, 0), token(2, 0)], urgent_jobs={1})  # job 1's first token
    assert outbox.urgent
    first = outbox.take(everything=False)
    assert first is not None and texts(first.events) == ["1.0"]
    assert not outbox.urgent and texts(outbox.events) == ["2.0"]

    outbox.extend([token(1, 1), token(2, 1)], urgent_jobs=set())
    outbox.extend([token(1, 2), token(2, 2, "length")], urgent_jobs={2})  # job 2's last token
    last = outbox.take(everything=False)
    assert last is not None and texts(last.events) == ["2.0", "2.1", "2.2"]
    assert texts(outbox.events) == ["1.1", "1.2"]

    rest = outbox.take()
    assert rest is not None and texts(rest.events) == ["1.1", "1.2"]
    assert outbox.take() is None


def test_an_urgent_event_added_alone_marks_its_job() -> None:
    outbox = Outbox()
    outbox.extend([token(1, 0), token(2, 0)], urgent_jobs=set())
    outbox.add(Dropped(2), urgent=True)  # job 2 cancelled: its answer must not wait
    frame = outbox.take(everything=False)
    assert frame is not None and frame.events == [token(2, 0), Dropped(2)]
    assert texts(outbox.events) == ["1.0"]


def test_stats_travel_with_any_frame() -> None:
    outbox = Outbox()
    outbox.extend([token(1, 0)], urgent_jobs=set())
    outbox.stats_of("rope", running=1, waiting=0)
    frame = outbox.take(everything=False)  # nothing urgent: the stats alone
    assert frame is not None and frame.events == [] and frame.stats[0].model == "rope"
    assert texts(outbox.events) == ["1.0"] and outbox.stats == {}


def test_flush_sends_only_when_something_is_urgent() -> None:
    sent: list[int] = []
    outbox = Outbox(send=lambda: sent.append(len(outbox.events)))
    outbox.extend([token(1, 0)], urgent_jobs=set())
    outbox.flush()
    assert sent == []
    outbox.extend([token(2, 0)], urgent_jobs={2})
    outbox.flush()
    assert sent == [2]


class SentFrames:
    """A channel that keeps what is sent."""

    def __init__(self) -> None:
        self.frames: list[list[str]] = []

    def send(self, outputs: Outputs) -> None:
        self.frames.append(texts(outputs.events))


class Decoding(EngineCore):
    busy = True  # as while a model decodes: ordinary tokens may wait


def test_the_process_loop_sends_urgent_jobs_at_once_and_the_rest_after_the_interval() -> None:
    config = EngineConfig(
        models=[], checkpoints="", device="cpu", dtype="float32", threads=1,
        max_batch_size=2, max_context=None, prefill_chunk=8, stream_interval=0.2,
        rope_variants=[],
    )  # fmt: skip
    channel = SentFrames()
    core = Decoding(config, channel)  # type: ignore[arg-type]
    core.outbox.extend([token(1, 0), token(2, 0)], urgent_jobs=set())
    core._send()  # the loop's send: the interval has passed since the start, so everything goes
    core.outbox.extend([token(1, 1), token(2, 1)], urgent_jobs=set())
    core.outbox.flush()
    core.outbox.extend([token(1, 2), token(2, 2, "length")], urgent_jobs={2})
    core.outbox.flush()
    assert channel.frames == [["1.0", "2.0"], ["2.1", "2.2"]]  # job 1's tokens wait
    time.sleep(0.25)
    core.outbox.extend([token(1, 3)], urgent_jobs=set())
    core.outbox.flush()  # nothing urgent: the step's tokens wait for the loop's own send
    assert len(channel.frames) == 2
    core._send()  # the loop's send after the step, the interval now passed
    assert channel.frames[-1] == ["1.1", "1.2", "1.3"]
