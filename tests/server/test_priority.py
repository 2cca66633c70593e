"""vLLM's ``priority`` through a real server: with the batch full and requests queued, a
``priority: -1`` request is admitted before every queued ``priority: 0`` one. The model's one
row is gated forward by forward, so the order the requests get their first token in is the
order they were admitted in."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from tests.server.conftest import running_server, test_settings, wait_for

MODEL = "none"


def test_priority_minus_one_is_admitted_before_every_queued_zero(checkpoints: Path) -> None:
    settings = test_settings(checkpoints, models=[MODEL], max_batch_size=1, stream_interval=0)
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
