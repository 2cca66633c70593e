"""The writer turns a job's events into pieces in the order the engine sent them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from model.sampling import SamplingParams
from server.api.errors import APIError
from server.api.job import Failure, Job
from server.api.schemas import CompletionRequest
from server.api.writer import CompletionWriter, Piece, joined
from server.messages import Token


def writer_and_job() -> tuple[CompletionWriter, Job]:
    body = CompletionRequest(model="m", prompt="x", return_tokens_as_token_ids=True)
    served: Any = SimpleNamespace(name="m", token_strings=[], token_bytes=[])
    job = Job([1, 2], SamplingParams(), max_tokens=5)
    return CompletionWriter(body, served, job.prompt_ids), job


@pytest.mark.parametrize("tokens_before_failure", [0, 1, 3])
def test_tokens_that_arrive_with_a_failure_are_written_before_it_raises(
    tokens_before_failure: int,
) -> None:
    """The engine may deliver a row's last tokens and its failure in one wake-up of the loop:
    the client must still see those tokens, then the error."""
    writer, job = writer_and_job()
    for token in range(tokens_before_failure):
        job.events.put_nowait(Token(1, token, f"t{token}", None))
    job.events.put_nowait(Failure(APIError(500, "broke", code="sampling_failed")))

    async def read() -> tuple[list[Piece], APIError]:
        written: list[Piece] = []
        with pytest.raises(APIError) as raised:
            async for pieces in writer.read(job):
                written.extend(pieces)
        return written, raised.value

    written, error = asyncio.run(read())
    assert "".join(text for text, _, _ in written) == "".join(
        f"t{t}" for t in range(tokens_before_failure)
    )
    assert error.code == "sampling_failed"
    assert writer.completion_tokens == tokens_before_failure


def test_tokens_that_arrive_together_leave_as_one_piece() -> None:
    writer, job = writer_and_job()
    for token, reason in [(0, None), (1, None), (2, "length")]:
        job.events.put_nowait(Token(1, token, f"t{token}", reason))

    async def read() -> list[list[Piece]]:
        return [pieces async for pieces in writer.read(job)]

    assert asyncio.run(read()) == [[("t0t1t2", None, "length")]]
    assert writer.completion_tokens == 3


def test_joined_keeps_each_piece_with_logprobs_apart_and_the_order() -> None:
    scored = {"tokens": ["b"], "token_logprobs": [-0.5]}
    pieces: list[Piece] = [
        ("a", None, None),
        ("b", scored, None),
        ("c", None, None),
        ("d", None, None),
        ("e", None, "stop"),
    ]
    assert joined(pieces) == [("a", None, None), ("b", scored, None), ("cde", None, "stop")]
    assert joined([]) == []
