"""Constrained jobs in the engine, without a process: a job waits apart while its grammar
compiles and the steps go on without it; a grammar that fails to compile ends its job with a
400 before it takes a row; one that fails at a later step ends its own job, and its batch's
other rows decode on (before, the failure escaped the per-row handling and failed the step)."""

from __future__ import annotations

import threading
from concurrent.futures import wait
from pathlib import Path
from typing import Any

import pytest
import torch

import model.grammar
from model.grammar import grammar_of
from model.sampling_params import SamplingParams
from server.engine.engine import ModelEngine, Outbox
from server.messages import Failed, Submit, Token
from tests.server.engine.test_engine_prefix import load

BOMB = "((a{100}){100}){100}"


def submit(engine: ModelEngine, job: int, params: SamplingParams, tokens: int = 8) -> None:
    prompt = [engine.loaded.bos, 5, 6, 7]
    engine.submit(Submit(job, engine.name, prompt, tokens, [], None, params, 0, False, 0.0))


def events_of(engine: ModelEngine) -> dict[int, list[Token | Failed]]:
    outputs = engine.outbox.take()
    assert outputs is not None
    events: dict[int, list[Token | Failed]] = {}
    for event in outputs.events:
        assert isinstance(event, Token | Failed), event
        events.setdefault(event.id, []).append(event)
    return events


@pytest.fixture(scope="module")
def engine(checkpoints: Path) -> ModelEngine:
    return ModelEngine(load(checkpoints), 4, 256, Outbox())


def test_a_job_waits_apart_while_its_grammar_compiles(
    engine: ModelEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    compile_ = model.grammar._compile

    def held(*args: Any) -> Any:
        release.wait(30)
        return compile_(*args)

    monkeypatch.setattr(model.grammar, "_compile", held)
    submit(engine, 0, SamplingParams(temperature=0.0, grammar=grammar_of("regex", "a{4}")))
    submit(engine, 1, SamplingParams(temperature=0.0))
    assert set(engine.compiling) == {0} and engine.stats().waiting == 2  # apart, and queued
    with torch.inference_mode():
        while not engine.idle:  # the plain job decodes to its end; no step waits
            engine.step()
            engine.take_compiled()
        assert set(engine.compiling) == {0}
        release.set()
        while engine.compiling or not engine.idle:
            engine.take_compiled()
            engine.step()
    events = events_of(engine)
    assert len(events[1]) == 8 and events[1][-1].finish_reason == "length"  # type: ignore[union-attr]
    assert all(isinstance(event, Token) for event in events[0])
    assert engine.loaded.tokenizer.decode([e.token for e in events[0]]) == "aaaa"  # type: ignore[union-attr]


def test_a_grammar_that_fails_to_compile_in_the_engine_is_a_400_without_a_row(
    engine: ModelEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model.grammar, "COMPILE_BUDGET", 0.0)
    submit(engine, 2, SamplingParams(grammar=grammar_of("regex", "b{3}")))
    wait([engine.compiling[2][1]._future])  # the worker is done with it
    engine.take_compiled()
    assert not engine.compiling and engine.idle and 2 not in engine.requests
    (failed,) = events_of(engine)[2]
    assert isinstance(failed, Failed) and failed.status == 400
    assert failed.message.startswith("structured output: compiling it took")


def test_a_grammar_failing_mid_batch_ends_its_own_job_and_the_others_decode_on(
    engine: ModelEngine,
) -> None:
    """The bomb compiles (its first mask is fine) and fails at its first token."""
    submit(engine, 3, SamplingParams(temperature=0.0), tokens=12)
    submit(engine, 4, SamplingParams(temperature=0.0, grammar=grammar_of("regex", BOMB)))
    wait([engine.compiling[4][1]._future])
    with torch.inference_mode():
        while engine.compiling or not engine.idle:
            engine.take_compiled()
            engine.step()
    assert engine.stats().failures == {"grammar_failed": 1}
    events = events_of(engine)
    assert len(events[3]) == 12 and events[3][-1].finish_reason == "length"  # type: ignore[union-attr]
    (failed,) = events[4]
    assert isinstance(failed, Failed) and (failed.status, failed.code) == (400, "grammar_failed")
    assert "too many expressions constructed" in failed.message
