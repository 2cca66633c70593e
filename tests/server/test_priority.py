"""vLLM's ``priority`` through a real server: with the batch full and requests queued, a
``priority: -1`` request is admitted before every queued ``priority: 0`` one. The model's one
row is gated forward by forward, so the order the requests get their first token in is the
order they were admitted in. Then issue 55's starvation: a flood of ``-1`` requests holds a
``0`` back only for ``--priority-aging`` seconds a level; and who may claim which priority
(``--max-priority``, ``--priority-keys``)."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from server.api.settings import Settings
from tests.server.conftest import Running, running_server, test_settings, wait_for

MODEL = "none"


def test_priority_minus_one_is_admitted_before_every_queued_zero(checkpoints: Path) -> None:
    settings = test_settings(
        checkpoints, models=[MODEL], max_batch_size=1, stream_interval=0, priority_aging=0
    )
    with running_server(settings) as server:
        started: list[str] = []  # by the first token each request got
        lock = threading.Lock()

        def send(name: str, priority: int) -> None:
            body = {"model": MODEL, "prompt": name, "max_tokens": 2, "ignore_eos": True}
            body |= {"priority": priority, "stream": True}
            with (
                httpx.Client(base_url=server.url, timeout=60) as client,
                client.stream("POST", "/v1/completions", json=body) as response,
            ):
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        with lock:
                            if name not in started:
                                started.append(name)

        held = server.gate(MODEL)
        threads: list[threading.Thread] = []

        def arrive(name: str, priority: int) -> None:
            threads.append(threading.Thread(target=send, args=(name, priority)))
            threads[-1].start()
            wait_for(lambda: server.engine(MODEL).in_flight == len(threads), f"{name} to arrive")

        def next_admitted() -> str:
            """Let forwards through one at a time until another request gets its first token."""
            count = len(started)
            while len(started) == count:
                held.allow(1)
                wait_for(lambda: held.settled, "the forward")
                time.sleep(0.05)  # its token reaches the stream
            return started[-1]

        arrive("holder", 0)  # takes the only row; its first forward waits at the gate
        for index in range(3):
            arrive(f"queued{index}", 0)
        arrive("urgent", -1)
        time.sleep(0.3)  # the frames reach the engine, which reads them all before a step
        order = [next_admitted() for _ in range(5)]
        held.open()
        for thread in threads:
            thread.join(60)
        assert order == ["holder", "urgent", "queued0", "queued1", "queued2"]


def test_priority_out_of_range_is_a_400(client: httpx.Client) -> None:
    answer = client.post("/v1/completions", json={"prompt": "a", "priority": 2**40})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "priority"


# ---- a flood of priority -1 requests (issue 55) ----------------------------------------------

FLOOD_CLIENTS = 12  # each sends its next priority -1 request as soon as its last one ends
FLOOD_TOKENS = 60  # per request: ~0.1-0.3 s on the tiny model here, long beside a round trip
AGING = 1.0  # the default --priority-aging


@contextmanager
def flood(server: Running) -> Iterator[list[float]]:
    """FLOOD_CLIENTS clients looping priority -1 completions while the block runs; yields the
    durations of the flood's requests so far, once every client's first one has arrived."""
    stop = threading.Event()
    durations: list[float] = []

    def client() -> None:
        body = {"model": MODEL, "prompt": "flood", "max_tokens": FLOOD_TOKENS}
        body |= {"ignore_eos": True, "priority": -1}
        with httpx.Client(base_url=server.url, timeout=60) as http:
            while not stop.is_set():
                start = time.monotonic()
                assert http.post("/v1/completions", json=body).status_code == 200
                durations.append(time.monotonic() - start)

    threads = [threading.Thread(target=client) for _ in range(FLOOD_CLIENTS)]
    for thread in threads:
        thread.start()
    try:
        engine = server.engine(MODEL)
        wait_for(lambda: engine.in_flight == FLOOD_CLIENTS, "the flood to fill the queue")
        yield durations
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)


def zero_priority_seconds(server: Running, limit: float) -> float | None:
    """How long a priority 0 request took beside the flood (None: not done within ``limit``)."""
    done = threading.Event()
    took: list[float] = []

    def send() -> None:
        body = {"model": MODEL, "prompt": "patient", "max_tokens": 4, "ignore_eos": True}
        start = time.monotonic()
        with httpx.Client(base_url=server.url, timeout=120) as http:
            assert http.post("/v1/completions", json={**body, "priority": 0}).status_code == 200
        took.append(time.monotonic() - start)
        done.set()

    thread = threading.Thread(target=send)
    thread.start()
    finished = done.wait(limit)
    return took[0] if finished else None


def test_aging_lets_a_priority_zero_request_through_a_flood_of_minus_ones(
    checkpoints: Path,
) -> None:
    """Two rows, twelve clients looping at priority -1: a priority 0 request waits out the
    flood without aging (vLLM's policy), and finishes within 5 s with the default aging of 1 s.
    Ten requests wait at all times (with six the queue drained while the test process's
    threads stalled on a busy host, and the 0 got through without aging)."""
    strict = test_settings(checkpoints, models=[MODEL], max_batch_size=2, priority_aging=0)
    with running_server(strict) as server:
        with flood(server) as durations:
            assert zero_priority_seconds(server, limit=6.0) is None  # starved
            flooded = len(durations)
        wait_for(lambda: server.engine(MODEL).in_flight == 0, "it to finish after the flood")
        assert flooded > 20  # the flood was served meanwhile

    aging = test_settings(checkpoints, models=[MODEL], max_batch_size=2)
    assert aging.priority_aging == AGING
    with running_server(aging) as server, flood(server) as durations:
        seconds = zero_priority_seconds(server, limit=5.0)
        assert seconds is not None, "the priority 0 request did not finish within 5 s"
        print(f"priority 0 beside the flood: {seconds:.2f} s")
        # it waited out the aging, then the -1s queued before it: not admitted at once
        assert seconds >= AGING, (seconds, statistics.median(durations))


# ---- who may claim which priority ------------------------------------------------------------

OPS = "ops-key"


def test_max_priority_and_priority_keys_bound_what_a_caller_may_claim(checkpoints: Path) -> None:
    settings = test_settings(
        checkpoints, models=[MODEL], max_priority=0, priority_keys=f"{OPS}:-10,batch-key:5"
    )
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 1}
    responses = {"model": MODEL, "input": "a", "max_output_tokens": 1}
    with running_server(settings) as server, httpx.Client(base_url=server.url) as client:
        for path, request in [
            ("/v1/completions", body),
            ("/v1/chat/completions", chat),
            ("/v1/responses", responses),
        ]:
            for key, priority, status in [
                (None, 0, 200),
                (None, 7, 200),
                (None, -1, 403),  # no key: max_priority 0 at most
                ("wrong", -1, 403),
                (OPS, -10, 200),
                (OPS, -11, 403),
                ("batch-key", 5, 200),
                ("batch-key", 4, 403),  # a key's own range, even above max_priority
            ]:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                answer = client.post(path, json={**request, "priority": priority}, headers=headers)
                assert answer.status_code == status, (path, key, priority, answer.text)
                if status == 403:
                    error = answer.json()["error"]
                    assert error["param"] == "priority" and error["type"] == "permission_error"
                    assert error["code"] == "priority_not_allowed"
                    assert str(priority) in error["message"]
        assert server.engine(MODEL).in_flight == 0


def test_priority_keys_are_api_keys_too(checkpoints: Path) -> None:
    """With an API key, each priority key is accepted in its place, with its own range; the API
    key itself may claim what max_priority allows."""
    settings = test_settings(
        checkpoints, models=[MODEL], api_key="main", max_priority=0, priority_keys=f"{OPS}:-5"
    )
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1}
    with running_server(settings) as server, httpx.Client(base_url=server.url) as client:
        for key, priority, status in [
            (None, 0, 401),
            ("main", 0, 200),
            ("main", -1, 403),
            (OPS, -5, 200),
            (OPS, -6, 403),
            ("nope", 0, 401),
        ]:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            answer = client.post(
                "/v1/completions", json={**body, "priority": priority}, headers=headers
            )
            assert answer.status_code == status, (key, priority, answer.text)
        assert (
            client.get("/v1/models", headers={"Authorization": f"Bearer {OPS}"}).status_code == 200
        )


def test_malformed_priority_keys_are_a_start_up_error() -> None:
    for value, why in [
        ("ops", "KEY:LOWEST"),
        ("ops:high", "KEY:LOWEST"),
        (":-5", "empty or blank key"),
        ("ops:-5,ops:0", "twice"),
        (f"ops:{2**31}", "outside"),
    ]:
        with pytest.raises(ValueError, match=why) as raised:
            Settings(priority_keys=value)
        assert "ops" not in str(raised.value).split("input_value")[0]  # the key is not shown
