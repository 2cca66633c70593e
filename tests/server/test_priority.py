"""vLLM's ``priority`` through a real server: with the batch full and requests queued, a
``priority: -1`` request is admitted before every queued ``priority: 0`` one."""

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
        finished: list[str] = []
        lock = threading.Lock()

        def send(name: str, priority: int) -> None:
            body = {"model": MODEL, "prompt": name, "max_tokens": 2, "priority": priority}
            with httpx.Client(base_url=server.url, timeout=60) as client:
                assert client.post("/v1/completions", json=body).status_code == 200
            with lock:
                finished.append(name)

        held = server.gate(MODEL)
        threads: list[threading.Thread] = []

        def start(name: str, priority: int) -> None:
            thread = threading.Thread(target=send, args=(name, priority))
            thread.start()
            threads.append(thread)
            wait_for(lambda: server.engine(MODEL).in_flight == len(threads), f"{name} to arrive")

        start("holder", 0)  # takes the only row; its forward waits at the gate
        for index in range(3):
            start(f"queued{index}", 0)
        start("urgent", -1)
        time.sleep(0.3)  # the frames reach the engine, which reads them all before its next step
        held.open()
        for thread in threads:
            thread.join(60)
        assert finished[0] == "holder"
        assert finished[1] == "urgent", finished
        assert finished[2:] == ["queued0", "queued1", "queued2"]


def test_priority_out_of_range_is_a_400(client: httpx.Client) -> None:
    answer = client.post("/v1/completions", json={"prompt": "a", "priority": 2**40})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "priority"
