"""Hot loading (``--watch-interval``): a checkpoint copied into the served folder while 8 streams
decode on another model answers on ``/v1/models``, and the streams go on with no error and no
gap over a second; a half-copied folder, a folder whose copy stopped before the weights, and a
corrupt one are reported in ``/health`` and never served; a failed folder that changes is
tried again."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from model.files import CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE
from tests.server.conftest import Running, running_server, test_settings, wait_for

LOOK = 0.1  # the watch interval of these tests, seconds
LOADED_WITHIN = 10.0  # the bound for a copied checkpoint to answer


class Streams:
    """``count`` clients streaming completions on ``model`` back to back until stopped, each
    recording the longest wait between two events and any error."""

    def __init__(self, url: str, model: str, count: int) -> None:
        self.url, self.model = url, model
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.longest_gap = 0.0
        self.tokens = 0
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(count)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "Now is", "max_tokens": 48, "ignore_eos": True}
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stop.is_set():
                try:
                    self._one(client, {**body, "stream": True})
                except Exception as error:  # any failure is what the test looks for
                    self.errors.append(repr(error))
                    return

    def _one(self, client: httpx.Client, body: dict[str, object]) -> None:
        with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                self.errors.append(f"{response.status_code}: {response.read()!r}")
                return
            last = time.monotonic()
            for line in response.iter_lines():
                now = time.monotonic()
                self.longest_gap = max(self.longest_gap, now - last)
                last = now
                if line.startswith("data: {"):
                    self.tokens += 1
                    if '"error"' in line:
                        self.errors.append(line)

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)


def health_of(running: Running, name: str) -> dict[str, str] | None:
    return httpx.get(f"{running.url}/health").json()["models"].get(name)


def served(running: Running) -> list[str]:
    return [model["id"] for model in httpx.get(f"{running.url}/v1/models").json()["data"]]


def failed_saying(running: Running, name: str, words: str) -> bool:
    state = health_of(running, name)
    return state is not None and state["state"] == "failed" and words in state["message"]


@pytest.fixture
def folder(tmp_path: Path, checkpoints: Path) -> Path:
    """A served folder holding the rope checkpoint alone."""
    shutil.copytree(checkpoints / "rope", tmp_path / "rope")
    return tmp_path


def test_a_copied_checkpoint_answers_while_streams_go_on(folder: Path, checkpoints: Path) -> None:
    settings = test_settings(folder, watch_interval=LOOK, max_batch_size=8, stream_interval=0)
    with running_server(settings) as running:
        assert served(running) == ["rope"]
        streams = Streams(running.url, "rope", 8)
        try:
            # A copy that stopped half-way through the weights: loaded, fails, reported.
            source, target = checkpoints / "learned", folder / "learned"
            target.mkdir()
            shutil.copy(source / CONFIG_FILE, target)
            shutil.copy(source / TOKENIZER_FILE, target)
            weights = (source / WEIGHTS_FILE).read_bytes()
            (target / WEIGHTS_FILE).write_bytes(weights[: len(weights) // 2])
            wait_for(lambda: failed_saying(running, "learned", ""), "the half copy's report")
            assert "learned" not in served(running)

            # The copy completes: the changed folder is tried again, and now it serves.
            copied = time.monotonic()
            (target / WEIGHTS_FILE).write_bytes(weights)
            wait_for(lambda: "learned" in served(running), "the copied model", LOADED_WITHIN)
            print(f"answered on /v1/models {time.monotonic() - copied:.2f} s after the copy")
            answer = httpx.post(
                f"{running.url}/v1/completions",
                json={"model": "learned", "prompt": "To be", "max_tokens": 4},
            )
            assert answer.status_code == 200, answer.text
            assert health_of(running, "learned") == {"state": "ready"}
        finally:
            streams.finish()
        assert streams.errors == []
        assert streams.tokens > 0
        assert streams.longest_gap < 1.0, f"a stream waited {streams.longest_gap:.2f} s"


def test_incomplete_and_corrupt_folders_are_reported_never_served(
    folder: Path, checkpoints: Path
) -> None:
    settings = test_settings(folder, watch_interval=LOOK)
    with running_server(settings) as running:
        # A copy that has stopped after the config: reported as missing the rest.
        (folder / "alibi").mkdir()
        shutil.copy(checkpoints / "alibi" / CONFIG_FILE, folder / "alibi")
        wait_for(
            lambda: failed_saying(running, "alibi", f"no {WEIGHTS_FILE}, {TOKENIZER_FILE}"),
            "the incomplete folder's report",
        )
        # Every file there, the weights not a safetensors file: the engine's load fails.
        shutil.copytree(checkpoints / "fox", folder / "fox")
        (folder / "fox" / WEIGHTS_FILE).write_bytes(b"\xff" * 4096)
        wait_for(lambda: failed_saying(running, "fox", ""), "the corrupt folder's report")
        # A folder without any checkpoint file is nobody's business.
        (folder / "notes").mkdir()
        (folder / "notes" / "readme.txt").write_text("not a checkpoint")
        time.sleep(5 * LOOK)
        health = httpx.get(f"{running.url}/health").json()
        assert "notes" not in health["models"]
        assert health["status"] == "degraded"  # rope serves; two folders failed
        assert served(running) == ["rope"]
        answer = httpx.post(
            f"{running.url}/v1/completions", json={"model": "fox", "prompt": "a", "max_tokens": 2}
        )
        assert answer.status_code == 503
        assert "fox" in answer.json()["error"]["message"]


def test_with_models_named_nothing_else_is_served(folder: Path, checkpoints: Path) -> None:
    settings = test_settings(folder, watch_interval=LOOK, models=["rope"])
    with running_server(settings) as running:
        shutil.copytree(checkpoints / "learned", folder / "learned")
        time.sleep(10 * LOOK)
        assert served(running) == ["rope"]
        assert health_of(running, "learned") is None


def scheme_of(running: Running, name: str) -> str | None:
    models = httpx.get(f"{running.url}/v1/models").json()["data"]
    return next((model["scheme"] for model in models if model["id"] == name), None)


def replace_atomically(source: Path, target: Path) -> None:
    """Put a copy of ``source`` in ``target``'s place as ``ordinal train`` writes: staged
    beside it under a hidden name, then swapped in by renames."""
    staged, old = target.parent / f".{target.name}-new", target.parent / f".{target.name}-old"
    shutil.copytree(source, staged)
    target.rename(old)
    staged.rename(target)
    shutil.rmtree(old)


def test_a_replaced_checkpoint_reloads_and_a_removed_one_goes(
    folder: Path, checkpoints: Path
) -> None:
    shutil.copytree(checkpoints / "learned", folder / "mine")
    settings = test_settings(folder, watch_interval=LOOK, stream_interval=0)
    with running_server(settings) as running:
        assert scheme_of(running, "mine") == "learned"
        streams = Streams(running.url, "mine", 4)  # streams on the model being replaced
        try:
            replace_atomically(checkpoints / "alibi", folder / "mine")
            wait_for(lambda: scheme_of(running, "mine") == "alibi", "the reload", LOADED_WITHIN)
            assert health_of(running, "mine") == {"state": "ready"}
        finally:
            streams.finish()
        assert streams.errors == []  # streams begun on the old weights ended normally

        # New files that fail to load: the weights loaded before still serve, and it says so.
        (folder / "mine" / WEIGHTS_FILE).write_bytes(b"\xff" * 4096)
        wait_for(
            lambda: "still serve" in (health_of(running, "mine") or {}).get("message", ""),
            "the failed reload's report",
        )
        assert scheme_of(running, "mine") == "alibi"

        shutil.rmtree(folder / "mine")
        wait_for(lambda: scheme_of(running, "mine") is None, "the unload", LOADED_WITHIN)
        assert health_of(running, "mine") is None
        answer = httpx.post(
            f"{running.url}/v1/completions", json={"model": "mine", "prompt": "a", "max_tokens": 2}
        )
        assert answer.status_code == 404
        assert served(running) == ["rope"]


def test_reload_acts_at_once_and_says_what_it_did(folder: Path, checkpoints: Path) -> None:
    settings = test_settings(folder, watch_interval=0, api_key="sesame")
    key = {"Authorization": "Bearer sesame"}
    with running_server(settings) as running:
        reload_url = f"{running.url}/v1/models/reload"
        assert httpx.post(reload_url).status_code == 401  # behind the API key

        shutil.copytree(checkpoints / "learned", folder / "learned")
        shutil.copytree(checkpoints / "fox", folder / "fox")
        (folder / "fox" / WEIGHTS_FILE).write_bytes(b"\xff" * 4096)
        (folder / "alibi").mkdir()
        shutil.copy(checkpoints / "alibi" / CONFIG_FILE, folder / "alibi")
        answer = httpx.post(reload_url, headers=key, timeout=60).json()
        assert answer["loaded"] == ["learned"]
        assert set(answer["failed"]) == {"fox", "alibi"}
        assert "no model.safetensors" in answer["failed"]["alibi"]
        assert answer["models"] == ["rope", "learned"]
        assert "learned" in [
            m["id"] for m in httpx.get(f"{running.url}/v1/models", headers=key).json()["data"]
        ]

        shutil.rmtree(folder / "learned")
        answer = httpx.post(reload_url, headers=key, timeout=60).json()
        assert answer["unloaded"] == ["learned"]
        assert answer["models"] == ["rope"]
        # Nothing changed since: a look that does nothing.
        again = httpx.post(reload_url, headers=key, timeout=60).json()
        assert again == {**again, "loaded": [], "failed": {}, "unloaded": []}
