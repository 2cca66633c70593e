"""clients/stream.py against a real ``ordinal serve`` app (uvicorn on a loopback port)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from clients.stream import default_url, main
from tests.server.conftest import (
    Running,
    free_socket,
    running_server,
    wait_for,
)
from tests.server.conftest import test_settings as server_settings

SCRIPT = Path(__file__).resolve().parents[2] / "clients" / "stream.py"
TIMING = re.compile(
    r"time to first token \d+\.\d+ s, (\d+\.\d|n/a) tokens/s \((\d+) tokens in (\d+) chunks\)"
)


@pytest.fixture(scope="module")
def server(checkpoints: Path) -> Iterator[Running]:
    settings = server_settings(checkpoints, models=["rope"], api_key="sesame")
    with running_server(settings, wait_ready=False) as running:
        # Longer than running_server's own wait: on a busy shared machine loading took ~30 s.
        service = running.service
        wait_for(lambda: service.settled, "rope", timeout=180)
        assert service.ready, service.health()
        yield running


def run_client(server: Running, *args: str) -> list[str]:
    return [args[0], "--url", server.url, "--model", "rope", "--api-key", "sesame", *args[1:]]


def completion_text(server: Running, body: dict[str, object]) -> str:
    """What the server answers to ``body`` without streaming."""
    headers = {"Authorization": "Bearer sesame"}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


# Every sampling option of the API; the client's flag for ``top_k`` is ``--top-k``.
OPTION_SETS = [
    {"seed": 1, "temperature": 0.8, "top_k": 40, "top_p": 0.95},
    {"seed": 7, "min_p": 0.05, "repetition_penalty": 1.3, "stop": ["e", "."]},
    {"seed": 0, "temperature": 0.0},  # zeros must be sent, not mistaken for "not given"
]


def as_flags(fields: dict[str, object]) -> list[str]:
    flags: list[str] = []
    for name, value in fields.items():
        for item in value if isinstance(value, list) else [value]:
            flags += [f"--{name.replace('_', '-')}", str(item)]
    return flags


@pytest.mark.parametrize("fields", OPTION_SETS)
@pytest.mark.parametrize("prompt", ["ROMEO:", "To be, or"])
def test_prints_what_the_server_completes_with_the_same_options(
    server: Running, capsys: pytest.CaptureFixture[str], prompt: str, fields: dict[str, object]
) -> None:
    exit_code = main(run_client(server, prompt, "--max-tokens", "24", *as_flags(fields)))
    out, err = capsys.readouterr()
    assert exit_code == 0, err
    body = {"model": "rope", "prompt": prompt, "max_tokens": 24, **fields}
    expected = completion_text(server, body)
    assert out == expected + "\n"
    timing = TIMING.fullmatch(err.strip())
    assert timing or (expected == "" and err.strip() == "no text received"), err


def test_runs_as_a_script_and_reports_its_timing(server: Running) -> None:
    args = run_client(server, "ROMEO:", "--max-tokens", "12", "--seed", "3")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    timing = TIMING.fullmatch(result.stderr.strip())
    assert timing and 1 <= int(timing[3]) <= int(timing[2]) <= 12, result.stderr


def test_the_rate_counts_tokens_where_a_chunk_carries_several(
    checkpoints: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An interval longer than the completion: the middle tokens leave with the last one, in one
    # chunk (the first leaves at once, in a chunk of its own unless the API process reads it
    # only once the rest has come).
    settings = server_settings(checkpoints, models=["rope"], stream_interval=60.0)
    body = {"model": "rope", "prompt": "ROMEO:", "max_tokens": 12, "seed": 3}
    with running_server(settings) as running:
        answer = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60).json()
        flags = ["--url", running.url, "--model", "rope", "--max-tokens", "12", "--seed", "3"]
        exit_code = main(["ROMEO:", *flags])
    out, err = capsys.readouterr()
    assert exit_code == 0, err
    assert out == answer["choices"][0]["text"] + "\n"
    tokens = answer["usage"]["completion_tokens"]
    timing = TIMING.fullmatch(err.strip())
    assert tokens > 2 and timing and int(timing[2]) == tokens and int(timing[3]) <= 2, err


def test_server_error_is_one_line_with_the_server_message(
    server: Running, capsys: pytest.CaptureFixture[str]
) -> None:
    exit_code = main([*run_client(server, "ROMEO:"), "--model", "no-such-model"])
    _, err = capsys.readouterr()
    body = {"model": "no-such-model", "prompt": "ROMEO:", "stream": True}
    headers = {"Authorization": "Bearer sesame"}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=30)
    assert answer.status_code == 404
    assert exit_code == 1
    assert err.count("\n") == 1
    assert "404" in err and answer.json()["error"]["message"] in err


def test_wrong_api_key_is_reported(server: Running, capsys: pytest.CaptureFixture[str]) -> None:
    exit_code = main([*run_client(server, "ROMEO:"), "--api-key", "wrong"])
    _, err = capsys.readouterr()
    assert exit_code == 1
    assert err.startswith("stream.py: error: server error 401") and err.count("\n") == 1


def test_nothing_listening_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    with free_socket() as sock:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound but not listening: refused
        exit_code = main(["ROMEO:", "--url", url])
    _, err = capsys.readouterr()
    assert exit_code == 1
    assert err.startswith(f"stream.py: error: cannot reach the server at {url}")
    assert err.count("\n") == 1


def test_silent_server_times_out(capsys: pytest.CaptureFixture[str]) -> None:
    with free_socket() as sock:
        sock.listen()  # the kernel accepts the connection; nobody ever answers
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        exit_code = main(["ROMEO:", "--url", url, "--timeout", "0.2"])
    _, err = capsys.readouterr()
    assert exit_code == 1
    assert err == f"stream.py: error: the server at {url} did not answer within 0.2 s\n"


def test_ctrl_c_exits_130_without_a_traceback() -> None:
    with free_socket() as sock:
        sock.listen()
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        client = subprocess.Popen(
            [sys.executable, str(SCRIPT), "ROMEO:", "--url", url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # A shell's background jobs inherit SIGINT ignored, and Python then never raises
            # KeyboardInterrupt: give the client the default disposition a terminal would.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        sock.settimeout(120)
        connection, _ = sock.accept()  # the client is now waiting for the answer
        client.send_signal(signal.SIGINT)
        _, err = client.communicate(timeout=120)
        connection.close()
    assert client.returncode == 130
    assert "Traceback" not in err


def test_the_server_comes_from_ordinal_url_or_ordinal_port(
    server: Running, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert default_url({}) == "http://127.0.0.1:8000"
    assert default_url({"ORDINAL_PORT": "8100"}) == "http://127.0.0.1:8100"
    both = {"ORDINAL_PORT": "8100", "ORDINAL_URL": "http://10.0.0.1:9/"}
    assert default_url(both) == "http://10.0.0.1:9"

    port = server.url.rsplit(":", 1)[1]
    for name, value in [("ORDINAL_URL", server.url), ("ORDINAL_PORT", port)]:
        monkeypatch.delenv("ORDINAL_URL", raising=False)
        monkeypatch.setenv(name, value)
        argv = ["ROMEO:", "--model", "rope", "--api-key", "sesame", "--max-tokens", "3"]
        assert main(argv) == 0, capsys.readouterr().err
        assert TIMING.search(capsys.readouterr().err)
