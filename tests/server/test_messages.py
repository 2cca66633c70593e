"""The frames between the API and the engine process: typed both ways, whole however the
bytes arrive, and a wrong field is an error at the boundary rather than later."""

from __future__ import annotations

import socket
import threading

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


def read_frames(sock: socket.socket, count: int) -> list[object]:
    """The next ``count`` engine messages on ``sock`` (the API process's end)."""
    decoder, data, messages = msgspec.msgpack.Decoder(FromEngine), b"", []
    while len(messages) < count:
        chunk = sock.recv(1 << 16)
        assert chunk, "the engine's end closed early"
        data += chunk
        while len(data) >= 4 and len(data) >= 4 + (length := int.from_bytes(data[:4], "big")):
            messages.append(decoder.decode(data[4 : 4 + length]))
            data = data[4 + length :]
    return messages


def test_sends_from_several_threads_arrive_whole_and_each_threads_in_order() -> None:
    """The sender thread writes what any thread sends, whole, in the order each thread sent."""
    ours, theirs = socket.socketpair()
    channel = Channel(theirs)

    def send_all(first: int) -> None:
        for job in range(first, first + 200):
            channel.send(Outputs([Token(job, job, "x" * (job % 7), None)], []))

    threads = [threading.Thread(target=send_all, args=(first,)) for first in (0, 1000)]
    for thread in threads:
        thread.start()
    ids = [message.events[0].id for message in read_frames(ours, 400)]  # type: ignore[attr-defined]
    for thread in threads:
        thread.join()
    assert [job for job in ids if job < 1000] == list(range(200))
    assert [job for job in ids if job >= 1000] == list(range(1000, 1200))


def test_finish_writes_what_is_queued_and_a_gone_peer_marks_the_channel_closed() -> None:
    """finish() returns once everything queued is written; a write to an end that has gone
    marks the channel closed (the decode loop then ends) rather than raising anywhere."""
    ours, theirs = socket.socketpair()
    channel = Channel(theirs)
    for job in range(5):
        channel.send(Outputs([Token(job, job, "a", None)], []))
    channel.finish()
    ours.settimeout(0.0)  # written already: nothing to wait for
    assert [m.events[0].id for m in read_frames(ours, 5)] == list(range(5))  # type: ignore[attr-defined]
    assert not channel.closed
    ours, theirs = socket.socketpair()
    channel = Channel(theirs)
    ours.close()
    channel.send(Outputs([Token(1, 2, "a", None)], []))
    channel.finish()
    assert channel.closed
