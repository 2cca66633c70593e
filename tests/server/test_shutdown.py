"""SIGTERM ends an idle ``ordinal serve`` within 2 s, whatever its engine process is doing:
serving, frozen (SIGSTOP), starting (importing torch before it reads its first message), or not
there at all while a crashed one's restart waits out its backoff. A server sent SIGTERM during
a backoff took 15 s to exit; ``docker stop`` kills at 10.

Each case runs the real command line in a process of its own (the signal is uvicorn's to
handle) and times it from the signal to its exit; its engine process must be gone too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.server.conftest import wait_for
from tests.test_deploy import REPO, free_port

EXIT_WITHIN = 2.0  # seconds from SIGTERM to the server's exit


class Server:
    """``ordinal serve`` of the rope checkpoint in a process of its own; its log is read as it
    is written (``lines``)."""

    def __init__(self, checkpoints: Path) -> None:
        self.port = free_port()
        command = [sys.executable, "-m", "ordinal", "serve", "--checkpoints", str(checkpoints)]
        command += ["--models", "rope", "--port", str(self.port), "--device", "cpu"]
        self.process = subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)

    def healthy(self) -> bool:
        assert self.process.poll() is None, "".join(self.lines)[-2000:]
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).is_success
        except httpx.HTTPError:
            return False

    def engine(self) -> psutil.Process | None:
        """The engine process (multiprocessing's spawn child), if one runs now."""
        for child in psutil.Process(self.process.pid).children():
            try:
                if "spawn_main" in " ".join(child.cmdline()):
                    return child
            except psutil.NoSuchProcess:
                continue
        return None

    def logged(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def terminate(self) -> float:
        """SIGTERM; seconds until the process exited (killed, and the test failed, past 20)."""
        sent = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError("the server did not exit within 20 s of SIGTERM") from None
        return time.monotonic() - sent

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._reader.join(5)


def serving(server: Server) -> None:
    wait_for(server.healthy, "the server to serve", timeout=120)


def frozen(server: Server) -> None:
    serving(server)
    engine = server.engine()
    assert engine is not None
    os.kill(engine.pid, signal.SIGSTOP)  # it never reads the Shutdown message


def starting(server: Server) -> None:
    """Signalled once its engine process runs but before any model is loaded: the engine is
    still importing torch (seconds), before it has read a message."""
    wait_for(lambda: server.engine() is not None, "an engine process", timeout=60)
    assert not server.healthy()


def in_backoff(server: Server) -> None:
    """Every engine killed at once, four times running: the restart waits 0.5, 1, 2, then 4 s
    (doubling while the engines do not last), and the signal comes during the 4 s wait."""
    serving(server)
    for delay in ("0.5", "1.0", "2.0", "4.0"):
        wait_for(lambda: server.engine() is not None, "an engine process", timeout=60)
        engine = server.engine()
        assert engine is not None
        engine.kill()
        line = f"restarting it in {delay} s"
        wait_for(lambda line=line: server.logged(line), line)
    assert server.engine() is None


@pytest.mark.parametrize("state", [serving, frozen, starting, in_backoff])
def test_sigterm_ends_an_idle_server_within_2_s_whatever_its_engine_does(
    checkpoints: Path, state: object
) -> None:
    server = Server(checkpoints)
    try:
        assert callable(state)
        state(server)
        engine = server.engine()
        took = server.terminate()
        assert took <= EXIT_WITHIN, (took, "".join(server.lines)[-2000:])
        if engine is not None:  # killed, not left behind
            wait_for(lambda: not engine.is_running(), "the engine process to end", timeout=2)
    finally:
        server.close()
