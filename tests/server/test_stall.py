"""A frozen engine (SIGSTOP) is not healthy: ``/health`` turns 503 within the configured stall
time once work waits, and the supervisor kills and restarts it (``server.api.client``)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.server.conftest import running_server, test_settings, wait_for

STALL = 1.0  # seconds: the server's engine_stall_timeout here


def test_a_stopped_engine_turns_health_503_and_is_restarted(checkpoints: Path) -> None:
    settings = test_settings(checkpoints, models=["rope"], engine_stall_timeout=STALL)
    with running_server(settings) as running, httpx.Client(base_url=running.url) as client:
        engine = running.service.engine
        assert engine is not None and engine.pid is not None
        first = engine.pid
        assert client.get("/health").status_code == 200
        os.kill(first, signal.SIGSTOP)
        time.sleep(2 * STALL)
        assert client.get("/health").status_code == 200  # stopped, but nothing waits for it
        answers: list[httpx.Response] = []
        body = {"prompt": "To be", "max_tokens": 5}
        request = threading.Thread(
            target=lambda: answers.append(client.post("/v1/completions", json=body, timeout=30))
        )
        stopped_at = time.monotonic()
        request.start()
        health = None
        while time.monotonic() - stopped_at < STALL + 2:
            health = client.get("/health")
            if health.status_code == 503:
                break
            # "stalled" shows until the supervisor's next look (≤ 0.25 s) kills the engine, then
            # "loading": poll often enough not to miss it on a loaded machine
            time.sleep(0.005)
        assert health is not None and health.status_code == 503
        assert health.json()["status"] == "stalled"
        assert time.monotonic() - stopped_at < STALL + 1.0
        request.join(30)
        assert answers[0].status_code == 503
        assert answers[0].json()["error"]["code"] == "engine_restarting"
        wait_for(lambda: engine.pid not in (None, first), "a new engine process")
        wait_for(lambda: running.service.ready, "the model to load again")
        assert client.get("/health").status_code == 200
        assert client.post("/v1/completions", json=body).status_code == 200
        assert engine.exitcode == -signal.SIGKILL  # the stopped one was killed, not left
