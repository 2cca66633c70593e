"""The engine's prefix cache (``server.engine.engine`` with ``model.prefix_cache``), without a
process: jobs whose prompts begin with a recent prompt's blocks decode what they decode with the
cache off, report the tokens reused on their first token, and count vLLM's queries and hits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.prefix_cache import BLOCK
from model.sampling_params import SamplingParams
from server.engine.engine import ModelEngine, Outbox
from server.engine.loader import LoadedModel, load_all
from server.messages import Submit, Token
from tests.server.conftest import engine_config

NEW_TOKENS = 5


def load(checkpoints: Path, name: str = "rope", variants: tuple[str, ...] = ()) -> LoadedModel:
    config = engine_config({"rope": checkpoints / "rope"}, checkpoints, list(variants))
    return next(r for r in load_all(config) if isinstance(r, LoadedModel) and r.name == name)


def run(
    engine: ModelEngine, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[list[Token]], tuple[int, int]]:
    """Submit ``prompts`` at once and step until every job has ended → each one's tokens, and
    the prefix cache's (queries, hits) meanwhile."""
    for job, prompt in enumerate(prompts):
        engine.submit(Submit(job, engine.name, prompt, NEW_TOKENS, [], None, params, 0, False, 0.0))
    tokens: list[list[Token]] = [[] for _ in prompts]
    with torch.inference_mode():
        while not engine.idle:
            engine.step()
    outputs = engine.outbox.take()
    assert outputs is not None
    for event in outputs.events:
        assert isinstance(event, Token), event
        tokens[event.id].append(event)
    (stats,) = outputs.stats
    return tokens, (stats.prefix_queries, stats.prefix_hits)


def prompts_of(loaded: LoadedModel) -> tuple[list[int], list[int], list[int]]:
    """A first prompt, one sharing its first 2 blocks and a bit, and an unrelated one."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, loaded.vocab, (3, 2 * BLOCK + 8), generator=generator).tolist()
    first = [loaded.bos, *ids[0]]
    return first, first[: 2 * BLOCK + 3] + ids[1][:6], [loaded.bos, *ids[2]]


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=11)]
)
def test_jobs_reusing_a_prefix_decode_as_with_the_cache_off(
    checkpoints: Path, params: SamplingParams
) -> None:
    loaded = load(checkpoints)
    first, sharing, unrelated = prompts_of(loaded)
    off = ModelEngine(loaded, 4, 256, Outbox(), prefix_cache_tokens=0)
    on = ModelEngine(loaded, 4, 256, Outbox(), prefix_cache_tokens=1024)
    assert off.prefix is None and on.prefix is not None
    expected, off_counts = run(off, [unrelated, sharing], params)

    _, first_counts = run(on, [first], params)
    # one step admits a job that misses, then one that hits: each takes its row in order
    got, counts = run(on, [unrelated, sharing], params)

    for ours, theirs in zip(got, expected, strict=True):
        assert [t.token for t in ours] == [t.token for t in theirs]
        ours_logprobs = [t.logprob for t in ours]
        assert ours_logprobs == pytest.approx([t.logprob for t in theirs], abs=1e-5)
    assert [tokens[0].cached_tokens for tokens in got] == [0, 2 * BLOCK]
    assert all(t.cached_tokens == 0 for tokens in got for t in tokens[1:])
    assert all(t.cached_tokens == 0 for tokens in expected for t in tokens)
    assert first_counts == (len(first), 0)
    assert counts == (len(unrelated) + len(sharing), 2 * BLOCK)
    assert off_counts == (0, 0)


def test_rope_with_dynamic_scaling_gets_no_prefix_cache(checkpoints: Path) -> None:
    loaded = load(checkpoints, "rope+dynamic2", ("dynamic2",))
    engine = ModelEngine(loaded, 4, 256, Outbox(), prefix_cache_tokens=1024)
    assert engine.prefix is None
    first, sharing, _ = prompts_of(loaded)
    run(engine, [first], SamplingParams(temperature=0.0))
    tokens, counts = run(engine, [sharing], SamplingParams(temperature=0.0))
    assert tokens[0][0].cached_tokens == 0 and counts == (0, 0)
