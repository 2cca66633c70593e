"""The engine with ``--speculative ngram`` (``server.engine.engine`` over ``model.speculative``),
without a process: its jobs stream the tokens they stream without it, several to a step where
drafts are kept, each job's budget and stop strings still exact, rows that cannot speculate
(logprobs, a repetition penalty) beside rows that do, and vLLM's counters counted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model import kernels
from model.sampling_params import SamplingParams
from model.speculative import Speculation
from server.engine.engine import ModelEngine, Outbox
from server.engine.loader import LoadedModel, load_all
from server.messages import ModelStats, Submit, Token
from tests.server.conftest import engine_config

pytestmark = pytest.mark.skipif(
    kernels.active() is None, reason="speculation needs the CPU decode kernel"
)

GREEDY = SamplingParams(temperature=0.0)
JOBS = [  # (sampling, logprobs, stop, max_tokens)
    (GREEDY, None, [], 40),
    (SamplingParams(temperature=0.9, seed=7), None, [], 33),
    (GREEDY, 2, [], 20),  # logprobs: decodes one token a step
    (SamplingParams(temperature=0.0, repetition_penalty=1.5), None, [], 25),
    (GREEDY, None, ["e"], 40),
    (SamplingParams(temperature=0.5, top_k=20, seed=3), None, [], 37),
]


def load(checkpoints: Path, variants: tuple[str, ...] = ()) -> dict[str, LoadedModel]:
    config = engine_config({"rope": checkpoints / "rope"}, checkpoints, list(variants))
    return {r.name: r for r in load_all(config) if isinstance(r, LoadedModel)}


def run(engine: ModelEngine, prompts: list[list[int]]) -> tuple[list[list[Token]], ModelStats]:
    """Each job of JOBS on its prompt, submitted at once, stepped until all end → each job's
    token events and the model's stats."""
    for job, (prompt, (params, logprobs, stop, most)) in enumerate(zip(prompts, JOBS, strict=True)):
        engine.submit(
            Submit(job, engine.name, prompt, most, stop, None, params, logprobs, False, 0)
        )
    with torch.inference_mode():
        while not engine.idle:
            engine.step()
    outputs = engine.outbox.take()
    assert outputs is not None
    tokens: list[list[Token]] = [[] for _ in prompts]
    for event in outputs.events:
        assert isinstance(event, Token), event
        tokens[event.id].append(event)
    (stats,) = outputs.stats
    return tokens, stats


def test_jobs_stream_what_they_stream_without_speculation(checkpoints: Path) -> None:
    loaded = load(checkpoints)["rope"]
    generator = torch.Generator().manual_seed(0)
    motif = torch.randint(3, loaded.vocab, (6,), generator=generator).tolist()
    prompts = [[loaded.bos, *motif * 4, *motif[: job % 5]] for job in range(len(JOBS))]
    plain = ModelEngine(loaded, 4, 64, Outbox())
    fast = ModelEngine(loaded, 4, 64, Outbox(), speculation=Speculation(4, ngram_min=1))
    assert plain.speculative is None and fast.speculative == "ngram, up to 4 tokens"
    expected, plain_stats = run(plain, prompts)
    got, stats = run(fast, prompts)
    for ours, theirs in zip(got, expected, strict=True):
        assert [t.token for t in ours] == [t.token for t in theirs]
        assert "".join(t.text for t in ours) == "".join(t.text for t in theirs)
        assert [t.finish_reason for t in ours] == [t.finish_reason for t in theirs]
        assert [t.stop for t in ours] == [t.stop for t in theirs]
        assert [t.logprob for t in ours] == pytest.approx([t.logprob for t in theirs], abs=1e-5)
    assert all(len(tokens) <= most for tokens, (*_, most) in zip(got, JOBS, strict=True))
    assert plain_stats.spec_drafts == 0
    assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    assert stats.spec_drafts <= stats.spec_draft_tokens
    assert stats.generation_tokens == plain_stats.generation_tokens
    # kept drafts mean fewer steps for the same tokens
    assert len(stats.inter_token) < len(plain_stats.inter_token)


def test_a_model_that_cannot_verify_says_so_and_decodes_as_usual(checkpoints: Path) -> None:
    loaded = load(checkpoints, ("dynamic2",))["rope+dynamic2"]
    engine = ModelEngine(loaded, 4, 64, Outbox(), speculation=Speculation(3))
    assert engine.speculative is not None and engine.speculative.startswith("off: ")
    assert "prefix-stable" in engine.speculative
    assert engine.batch.speculation is None
    prompts = [[loaded.bos, 5, 6, 7, 5, 6, 7, 5, 6] for _ in JOBS]
    _, stats = run(engine, prompts)
    assert stats.spec_drafts == 0 and stats.generation_tokens > 0
