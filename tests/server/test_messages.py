"""The frames between the API and the engine process: typed both ways, whole however the
bytes arrive, and a wrong field is an error at the boundary rather than later."""

from __future__ import annotations

import socket

import msgspec
import pytest

from model.sampling import SamplingParams
from server.messages import (
    Cancel,
    Channel,
    FromEngine,
    Outputs,
    Submit,
    ToEngine,
    Token,
    frame,
)

SUBMIT = Submit(
    id=7,
    model="rope",
    prompt_ids=[1, 2, 3],
    max_tokens=4,
    stop=["\n"],
    eos_id=None,
    params=SamplingParams(temperature=0.5, logit_bias=((3, -1.5),), seed=2**64 - 1),
    logprobs=2,
    score_prompt=False,
    submitted_at=12.5,
)


def test_every_message_comes_back_as_it_was_sent() -> None:
    to_engine = msgspec.msgpack.Decoder(ToEngine)
    from_engine = msgspec.msgpack.Decoder(FromEngine)
    assert to_engine.decode(frame(SUBMIT)[4:]) == SUBMIT
    assert to_engine.decode(frame(Cancel(7))[4:]) == Cancel(7)
    outputs = Outputs([Token(7, 42, "a", "stop", -0.5, [42], [-0.5])], [])
    assert from_engine.decode(frame(outputs)[4:]) == outputs


def test_a_wrong_field_is_refused_at_the_boundary() -> None:
    decoder = msgspec.msgpack.Decoder(ToEngine)
    wrong = msgspec.msgpack.encode(["Submit", 7, "rope", "not ids", 4])
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(wrong)
    with pytest.raises(msgspec.ValidationError):  # an engine message is not one for the engine
        decoder.decode(frame(Outputs([], []))[4:])
    raw = msgspec.msgpack.decode(frame(SUBMIT)[4:])  # ["Submit", id, model, ...]
    raw[7]["temperature"] = -1.0  # SamplingParams checks its own fields on the way in
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        decoder.decode(msgspec.msgpack.encode(raw))


def test_the_channel_reassembles_frames_split_and_joined_anyhow() -> None:
    ours, theirs = socket.socketpair()
    channel = Channel(theirs)
    data = frame(SUBMIT) + frame(Cancel(1)) + frame(Cancel(2))
    ours.sendall(data[:3])
    assert channel.receive(0.0) == []  # not even a header yet
    ours.sendall(data[3:20])
    assert channel.receive(0.0) == []
    ours.sendall(data[20:])
    received = channel.receive(1.0)
    while len(received) < 3:
        received += channel.receive(1.0)
    assert received == [SUBMIT, Cancel(1), Cancel(2)]
    ours.close()
    assert channel.receive(1.0) == [] and channel.closed
