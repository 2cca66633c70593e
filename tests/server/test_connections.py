"""Connections as an attacker opens them: a rebinding page's foreign ``Host``, sockets that never
send a request, more idle sockets than the server has open files (``server.api.connections``,
``server.api.middleware.AllowHosts``)."""

from __future__ import annotations

import contextlib
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.api.middleware import host_name
from tests.server.conftest import Running, running_server, test_settings
from tests.test_deploy import REPO, free_port, wait_until_healthy

IDLE_CONNECTIONS, OPEN_FILES = 1_100, 1_024


def test_host_names_are_read_without_port_case_or_final_dot() -> None:
    assert host_name("127.0.0.1:8000") == "127.0.0.1"
    assert host_name("[::1]:8000") == "::1"
    assert host_name("::1") == "::1"
    assert host_name("LocalHost.:80") == "localhost"
    assert host_name("evil.example") == "evil.example"


def test_a_foreign_host_gets_a_400_on_loopback(server: Running) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for path in ("/health", "/v1/models"):
            response = client.get(path, headers={"Host": "evil.example"})
            assert response.status_code == 400, path
            error = response.json()["error"]
            assert error["code"] == "host_not_allowed" and "evil.example" in error["message"]
        body = {"prompt": "To be", "max_tokens": 2}
        refused = client.post("/v1/completions", json=body, headers={"Host": "evil.example:80"})
        assert refused.status_code == 400
        for name in ("localhost", "127.0.0.1", "[::1]"):
            port = server.url.rsplit(":", 1)[1]
            answer = client.post("/v1/completions", json=body, headers={"Host": f"{name}:{port}"})
            assert answer.status_code == 200, name


def test_allowed_hosts_replace_the_loopback_names(checkpoints: Path) -> None:
    settings = test_settings(checkpoints, models=["rope"], allowed_hosts=["ordinal.example"])
    with running_server(settings) as running, httpx.Client(base_url=running.url) as client:
        assert client.get("/health", headers={"Host": "ordinal.example:1"}).status_code == 200
        assert client.get("/health").status_code == 400  # 127.0.0.1 is not in the list


def test_a_connection_that_sends_no_request_is_closed_after_the_header_timeout(
    checkpoints: Path,
) -> None:
    settings = test_settings(checkpoints, models=["rope"], header_timeout=0.5)
    with running_server(settings) as running:
        port = int(running.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as silent, \
                socket.create_connection(("127.0.0.1", port), timeout=5) as slow:  # fmt: skip
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            started = time.monotonic()
            assert silent.recv(1) == b"" and slow.recv(1) == b""  # closed by the server
            assert 0.4 < time.monotonic() - started < 3


@contextlib.contextmanager
def more_open_files(count: int) -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < count:
        pytest.skip(f"this process may open only {hard} files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, count), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def limit_open_files() -> None:  # runs in the server's process before it starts
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


def test_more_idle_connections_than_open_files_leave_health_answering(
    checkpoints: Path,
) -> None:
    port = free_port()
    serve = [sys.executable, "-m", "ordinal", "serve", "--checkpoints", str(checkpoints)]
    serve += ["--models", "rope", "--port", str(port), "--device", "cpu", "--header-timeout", "60"]
    server = subprocess.Popen(
        serve,
        cwd=REPO,
        preexec_fn=limit_open_files,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    idle: list[socket.socket] = []
    try:
        wait_until_healthy(url, server, timeout=90)
        with more_open_files(IDLE_CONNECTIONS + 200):
            try:
                for _ in range(IDLE_CONNECTIONS):
                    idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                time.sleep(0.5)  # the server has accepted them all
                answers = [httpx.get(f"{url}/health", timeout=5).status_code for _ in range(5)]
                assert answers == [200] * 5
                # The server holds at most its limit: the oldest idle sockets were closed.
                closed = 0
                for sock in idle[:200]:
                    sock.setblocking(False)
                    with contextlib.suppress(BlockingIOError):
                        closed += sock.recv(1) == b""
                assert closed > 100
            finally:
                for sock in idle:
                    sock.close()
    finally:
        server.terminate()
        _, log = server.communicate(timeout=30)
    assert "connection limit (960 open) reached" in log
