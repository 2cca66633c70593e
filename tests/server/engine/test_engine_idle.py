"""An idle model gives its KV cache's growth back on its own clock (``ModelEngine.shrink_due``),
whatever the other models are doing, and not before ``IDLE_SHRINK`` seconds without a step."""

from __future__ import annotations

from pathlib import Path

import torch

from model.sampling_params import SamplingParams
from server.engine.engine import IDLE_SHRINK, ModelEngine, Outbox
from server.messages import Submit
from tests.server.engine.test_engine_prefix import load


def test_an_idle_model_shrinks_when_due_and_not_before(checkpoints: Path) -> None:
    loaded = load(checkpoints)
    engine = ModelEngine(loaded, 4, 256, Outbox())
    assert engine.shrink_due is None  # nothing grown yet
    prompt = [loaded.bos, *range(5, 100)]  # past the 64 positions a cache starts with
    engine.submit(Submit(0, engine.name, prompt, 2, [], None, SamplingParams(), 0, False, 0.0))
    with torch.inference_mode():
        engine.step()
        assert engine.shrink_due is None  # working
        while not engine.idle:
            engine.step()
    due = engine.shrink_due
    assert due is not None and engine.batch.cache.grown
    engine.shrink_if_due(due - IDLE_SHRINK / 2)
    assert engine.batch.cache.grown  # kept for the next request
    engine.shrink_if_due(due)
    assert not engine.batch.cache.grown and engine.shrink_due is None
