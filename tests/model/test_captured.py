"""Captured decode steps (``model.captured``): the fixed-shape step a CUDA graph records decodes
exactly as the ordinary step does, for every scheme, beside rows still prefilling (the padding
of its row bucket) and across the cache's growth. Off a GPU the same step runs eagerly; on a
GPU the last tests replay it from graphs."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from model.captured import row_bucket
from model.decode import DecodeBatch, Row, Tokens
from model.positional import SCHEMES
from model.positional.base import PositionOutOfRange
from model.sampling import RowSampler, SamplingParams
from model.transformer import Transformer
from tests.model.conftest import ALL_SCHEMES, TINY_VOCAB, random_model, random_tokens
from tests.model.test_decode import MAX_LENGTH, Sequence, run_schedule

GREEDY = SamplingParams(temperature=0.0)
TOP = 5  # logprobs compared per step


def test_a_row_bucket_is_the_next_power_of_two_within_the_most() -> None:
    for most in (1, 6, 64):
        for rows in range(1, most + 1):
            bucket = row_bucket(rows, most)
            assert rows <= bucket <= most
            assert bucket == most or (bucket & (bucket - 1) == 0 and bucket < 2 * rows)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]
# Every scheme but PaTH's, which turns its cached keys each pass: decoded eagerly (below).
CAPTURABLE = [scheme for scheme in ALL_SCHEMES if not SCHEMES[scheme].rewrites_keys]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", CAPTURABLE)
def test_fixed_shape_steps_decode_as_alone_while_rows_join_leave_and_prefill(
    scheme: str, device: str
) -> None:
    """The schedule of test_decode (random arrivals, chunked prompts, cancellations, a cache
    that grows), every decode step the fixed-shape one (replayed from graphs on a GPU): each
    sequence decodes its tokens alone, decoded the ordinary way, seeded sampling included."""
    rng = random.Random(f"captured {scheme}")
    model = random_model(scheme, seed=1).to(device)
    batch = DecodeBatch(model, 6, MAX_LENGTH, TINY_VOCAB, 0, grow=True, graphs=True)
    sequences = [Sequence(rng, seed) for seed in range(10)]
    with torch.inference_mode():
        cancelled = run_schedule(batch, sequences, rng)
        assert batch.captured is not None and batch.captured.failure is None
        assert batch.captured.steps  # the fixed-shape step did run
        for index, sequence in enumerate(sequences):
            alone = DecodeBatch(model, 1, MAX_LENGTH, TINY_VOCAB, 0, graphs=False)
            got = sequence.row.tokens.generated_ids
            wanted = decode_alone(alone, sequence.prompt, sequence.params, len(got))
            assert got == wanted or (index in cancelled and got == wanted[: len(got)]), index


def decode_alone(batch: DecodeBatch, prompt: list[int], params: SamplingParams, n: int) -> list:
    if n == 0:
        return []
    row = Row(Tokens(list(prompt), []), RowSampler(params))
    sampled = batch.step([(row, len(prompt))])
    while True:
        assert sampled is not None
        row.tokens.generated_ids.append(sampled.tokens[0])
        if len(row.tokens.generated_ids) == n:
            return row.tokens.generated_ids
        sampled = batch.step()


def paired_steps(model: Transformer, steps: int) -> tuple[DecodeBatch, DecodeBatch]:
    """Two batches of ``model``, ordinary and fixed-shape (replayed on a GPU), driven alike:
    three rows decode greedily (a bucket of four) while a fourth row's prompt arrives one
    token a step behind them, so the bucket's padding row holds a sequence. Each step's
    tokens and top logprobs are compared; returns both batches."""
    device = model.token_embedding.weight.device
    prompts = random_tokens(4, 20, seed=5).tolist()
    prompts = [prompts[0][:7], prompts[1][:12], prompts[2][:3], prompts[3]]
    batches = [
        DecodeBatch(model, 6, MAX_LENGTH, TINY_VOCAB, 0, grow=True, graphs=graphs)
        for graphs in (False, True)
    ]
    assert batches[1].captured is not None and batches[1].captured.replay == (device.type == "cuda")
    rows = [[Row(Tokens(list(p), []), RowSampler(GREEDY), logprobs=TOP) for p in prompts]]
    rows.append([Row(Tokens(list(p), []), RowSampler(GREEDY), logprobs=TOP) for p in prompts])
    with torch.inference_mode():
        draws = [
            b.step([(r, len(r.tokens.prompt_ids)) for r in rs[:3]])
            for b, rs in zip(batches, rows, strict=True)
        ]
        for step in range(steps):
            assert draws[0] is not None and draws[1] is not None
            assert draws[0].tokens == draws[1].tokens, step
            assert draws[0].logprobs is not None and draws[1].logprobs is not None
            for ours, theirs in zip(draws[0].logprobs[1:3], draws[1].logprobs[1:3], strict=True):
                torch.testing.assert_close(
                    torch.tensor(theirs), torch.tensor(ours), atol=1e-4, rtol=0
                )
            for sampled in draws:
                for row, token in zip(sampled.rows, sampled.tokens, strict=True):
                    row.tokens.generated_ids.append(token)
            arriving = step < len(prompts[3])
            draws = [
                b.step([(rs[3], 1)] if arriving else [])
                for b, rs in zip(batches, rows, strict=True)
            ]
    return batches[0], batches[1]


@pytest.mark.parametrize("scheme", ALL_SCHEMES)
def test_the_padding_row_is_left_as_it_was(scheme: str) -> None:
    """The prefilling row behind the decoding rows is padding in every fixed-shape step: its
    cached keys, values and key states are those the ordinary steps leave."""
    ordinary, fixed = paired_steps(random_model(scheme, seed=3), steps=24)
    for row in range(4):
        length = int(ordinary.cache.lengths[row])
        assert int(fixed.cache.lengths[row]) == length
        for theirs, ours in zip(
            ordinary.cache.slots(row, length), fixed.cache.slots(row, length), strict=True
        ):
            if theirs is not None:
                torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_a_position_past_the_table_raises_as_the_ordinary_step_does() -> None:
    model = random_model("learned", seed=2, max_positions=16, context_length=16)
    batch = DecodeBatch(model, 2, 32, TINY_VOCAB, 0, graphs=True)
    row = Row(Tokens(random_tokens(1, 15, seed=1)[0].tolist(), []), RowSampler(GREEDY))
    with torch.inference_mode():
        sampled = batch.step([(row, 15)])  # position 14: the last row of the table
        assert sampled is not None
        sampled = batch.step()  # position 15 is in range: a fixed-shape step
        with pytest.raises(PositionOutOfRange):
            batch.step()  # position 16 is not


def test_steps_recorded_for_a_smaller_cache_are_dropped_when_it_grows() -> None:
    model = random_model("alibi", seed=4)
    batch = DecodeBatch(model, 4, 160, TINY_VOCAB, 0, grow=True, graphs=True)  # from 64 slots
    batch.cache.grows_to_most = False  # doubling, as on the GPU that records graphs
    row = Row(Tokens(random_tokens(1, 5, seed=2)[0].tolist(), []), RowSampler(GREEDY))
    assert batch.captured is not None
    with torch.inference_mode():
        batch.step([(row, 5)])
        lengths = set()
        for _ in range(150):
            batch.step()
            (length,) = {length for _, length in batch.captured.steps}  # only the current one
            assert length == batch.cache.allocated[1]
            lengths.add(length)
    assert lengths == {64, 128, 160}  # it grew twice


@pytest.mark.parametrize("scheme", ["rope+dynamic", "path"])
def test_a_scheme_whose_cache_follows_the_pass_decodes_eagerly(scheme: str) -> None:
    """rope's dynamic scaling picks its base from each pass's longest position, and PaTH turns
    its cached keys by every new token: never captured, and decoded as without graphs."""
    dynamic = {"scheme": "rope", "scaling": "dynamic", "scaling_factor": 2.0}
    model = (
        random_model("rope", seed=5, positional=dynamic)
        if scheme == "rope+dynamic"
        else random_model(scheme, seed=5)
    )
    prompt = random_tokens(1, 9, seed=3)[0].tolist()
    fixed = DecodeBatch(model, 2, MAX_LENGTH, TINY_VOCAB, 0, graphs=True)
    ordinary = DecodeBatch(model, 2, MAX_LENGTH, TINY_VOCAB, 0, graphs=False)
    with torch.inference_mode():
        got = decode_alone(fixed, prompt, GREEDY, 20)
        assert got == decode_alone(ordinary, prompt, GREEDY, 20)
    assert fixed.captured is not None and "depend on each pass" in (fixed.captured.failure or "")
    assert not fixed.captured.steps


@cuda
@pytest.mark.parametrize("scheme", CAPTURABLE)
def test_replayed_graphs_decode_as_the_ordinary_steps_on_a_gpu(scheme: str) -> None:
    """float32 on the GPU, every scheme captured (no host read inside its step)."""
    model = random_model(scheme, seed=3).cuda()
    _ordinary, replayed = paired_steps(model, steps=24)
    assert replayed.captured is not None and replayed.captured.failure is None
    assert replayed.captured.steps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", CAPTURABLE)
def test_fixed_shape_steps_give_the_full_forwards_logprobs(scheme: str, device: str) -> None:
    """Cached = full forward: each token's logprob from 20 fixed-shape steps (replayed from
    graphs on a GPU) is the one an uncached forward over the whole sequence gives."""
    model = random_model(scheme, seed=6).to(device)
    prompt = random_tokens(1, 9, seed=4)[0].tolist()
    batch = DecodeBatch(model, 2, MAX_LENGTH, TINY_VOCAB, 0, graphs=True)
    row = Row(Tokens(prompt, []), RowSampler(GREEDY), logprobs=1)
    chosen = []
    with torch.inference_mode():
        sampled = batch.step([(row, len(prompt))])
        for _ in range(20):
            assert sampled is not None and sampled.logprobs is not None
            chosen.append(sampled.logprobs[1][0])
            row.tokens.generated_ids.append(sampled.tokens[0])
            sampled = batch.step()
        ids = torch.tensor([prompt + row.tokens.generated_ids], device=device)
        predicting = model(ids)[0, len(prompt) - 1 : -1].float().log_softmax(-1)  # [20, V]
        expected = predicting.gather(-1, ids[0, len(prompt) :, None])[:, 0]
    assert batch.captured is not None and batch.captured.steps
    torch.testing.assert_close(torch.tensor(chosen), expected.cpu(), atol=1e-4, rtol=0)


class _FailingCapture:
    """torch.cuda's capture API as a CPU test needs it: streams that run the warm-up where it
    is, and a capture that fails as a real one can (an op that may not be recorded)."""

    class Stream:
        def wait_stream(self, stream: object) -> None:
            pass

    @staticmethod
    def stream(stream: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @staticmethod
    def current_stream() -> _FailingCapture.Stream:
        return _FailingCapture.Stream()

    class CUDAGraph:
        pass

    @staticmethod
    def graph(*args: object, **kwargs: object) -> contextlib.AbstractContextManager[None]:
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_capture_that_fails_decodes_eagerly_from_then_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The fallback, on a CPU with a fake capture: the first step's recording fails, the step
    runs eagerly (the warm-up's writes are the step's own), nothing is recorded again, and every
    token is the ordinary batch's."""
    model = random_model("rope", seed=7)
    prompt = random_tokens(1, 9, seed=8)[0].tolist()
    ordinary = DecodeBatch(model, 2, MAX_LENGTH, TINY_VOCAB, 0, graphs=False)
    failing = DecodeBatch(model, 2, MAX_LENGTH, TINY_VOCAB, 0, graphs=True)
    assert failing.captured is not None and failing.captured.failure is None
    failing.captured.replay = True  # as on a GPU: record, then replay
    for name in ("Stream", "stream", "current_stream", "CUDAGraph", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(_FailingCapture, name))
    with torch.inference_mode(), caplog.at_level("WARNING", logger="ordinal.captured"):
        got = decode_alone(failing, prompt, GREEDY, 12)
        assert got == decode_alone(ordinary, prompt, GREEDY, 12)
    assert (failing.captured.failure or "").startswith("capturing a step failed: operation")
    assert not failing.captured.steps
    assert [record.message for record in caplog.records] == [
        f"{failing.captured.failure}: decoding eagerly"
    ]
