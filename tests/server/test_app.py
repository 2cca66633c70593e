"""Readiness, /v1/models, /metrics, /v1/tokenize, and settings from flags and the environment."""

from __future__ import annotations

import argparse
import shutil
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import server.service
from model.checkpoint import WEIGHTS_FILE, load_checkpoint
from model.generate import encode_prompt
from model.positional import TABLE_SCHEMES
from server.app import add_arguments, settings_from_args
from server.cli import build_parser, main
from server.settings import Settings
from tests.server.conftest import (
    CONTEXT_LENGTH,
    MAX_POSITIONS,
    SCHEME_SETTINGS,
    Running,
    running_server,
    test_settings,
    wait_for,
)


def test_health_is_503_until_the_models_are_loaded(
    checkpoints: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    load = server.service.load_checkpoint

    def slow_load(*args: Any, **kwargs: Any) -> Any:
        release.wait(30)
        return load(*args, **kwargs)

    monkeypatch.setattr(server.service, "load_checkpoint", slow_load)
    with (
        running_server(test_settings(checkpoints, models=["rope"]), wait_ready=False) as running,
        httpx.Client(base_url=running.url, timeout=30) as client,
    ):
        for response in (
            client.get("/health"),
            client.get("/v1/models"),
            client.post("/v1/completions", json={"prompt": "a"}),
        ):
            assert response.status_code == 503
            assert response.headers["retry-after"] == "1"
            assert "loading" in response.json()["error"]["message"]
        release.set()
        wait_for(lambda: running.service.ready, "the models to load")
        assert client.get("/health").json() == {
            "status": "ok",
            "models": {"rope": {"state": "ready"}},
        }


def _break(folder: Path, how: str) -> str:
    """Damage the checkpoint ``folder`` in one way; return what its 503 must mention."""
    weights = folder / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    if how == "truncated":
        weights.write_bytes(data[: len(data) // 2])
        return "truncated"
    if how == "corrupted":  # bytes flipped inside the weight data: only the checksum can tell
        data[-100:-90] = bytes(255 - byte for byte in data[-100:-90])
        weights.write_bytes(bytes(data))
        return "checksum"
    config = folder / "config.json"
    config.write_text(config.read_text().replace('"n_heads": 4', '"n_heads": 5'))
    return "config.json"


def test_broken_checkpoints_fail_alone(checkpoints: Path, tmp_path: Path) -> None:
    """A truncated, a corrupted and a badly configured checkpoint beside healthy ones: the
    healthy ones serve, each broken one answers 503 naming its file and what is wrong."""
    broken = {"rope": "truncated", "alibi": "corrupted", "t5": "bad config"}
    for name in (*broken, "none", "learned"):
        shutil.copytree(checkpoints / name, tmp_path / name)
    expected = {name: _break(tmp_path / name, how) for name, how in broken.items()}
    with (
        running_server(test_settings(tmp_path)) as running,
        httpx.Client(base_url=running.url, timeout=30) as client,
    ):
        health = client.get("/health")
        assert health.status_code == 200
        states = health.json()["models"]
        assert {name: state["state"] for name, state in states.items()} == {
            "rope": "failed",
            "alibi": "failed",
            "t5": "failed",
            "none": "ready",
            "learned": "ready",
        }
        assert health.json()["status"] == "degraded"
        for name in ("none", "learned"):
            response = client.post(
                "/v1/completions", json={"model": name, "prompt": "To be", "max_tokens": 3}
            )
            assert response.status_code == 200, response.text
        for name, mention in expected.items():
            assert mention in states[name]["message"], states[name]
            assert str(tmp_path) not in states[name]["message"]  # no absolute paths
            response = client.post("/v1/completions", json={"model": name, "prompt": "To be"})
            assert response.status_code == 503
            error = response.json()["error"]
            assert error["type"] == "server_error" and error["code"] == "unavailable"
            assert name in error["message"] and mention in error["message"], error
        # rope (the default) failed, so a request naming no model says so
        response = client.post("/v1/completions", json={"prompt": "To be"})
        assert response.status_code == 503 and "rope" in response.json()["error"]["message"]
        listed = [entry["id"] for entry in client.get("/v1/models").json()["data"]]
        assert sorted(listed) == ["learned", "none"]


def test_health_is_503_when_no_model_loads(checkpoints: Path, tmp_path: Path) -> None:
    shutil.copytree(checkpoints / "rope", tmp_path / "rope")
    _break(tmp_path / "rope", "truncated")
    with (
        running_server(test_settings(tmp_path)) as running,
        httpx.Client(base_url=running.url, timeout=30) as client,
    ):
        response = client.get("/health")
        assert response.status_code == 503
        body = response.json()
        assert body["status"] == "failed" and "no model could be loaded" in body["error"]["message"]
        assert "truncated" in body["models"]["rope"]["message"]


def test_models_describe_each_scheme(
    server: Running, client: httpx.Client, checkpoints: Path
) -> None:
    listed = {entry["id"]: entry for entry in client.get("/v1/models").json()["data"]}
    assert set(listed) == set(SCHEME_SETTINGS)
    for name, entry in listed.items():
        stored = load_checkpoint(checkpoints / name, "cpu").model
        table = name in TABLE_SCHEMES
        assert entry["scheme"] == name
        assert entry["context_length"] == CONTEXT_LENGTH
        assert entry["parameters"] == sum(p.numel() for p in stored.parameters())
        assert entry["max_positions"] == stored.positional.max_positions
        assert entry["max_context"] == (MAX_POSITIONS if table else 4 * CONTEXT_LENGTH)
        assert entry["default"] == (name == "rope")
    assert listed["binary"]["max_positions"] == 2**8
    assert listed["rope"]["max_positions"] is None


def metric_values(client: httpx.Client) -> dict[tuple[str, str], float]:
    """(sample name, label values joined) → value, from /metrics."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            values[(sample.name, ",".join(sample.labels.values()))] = sample.value
    return values


def test_metrics_count_requests_and_tokens(client: httpx.Client) -> None:
    before = metric_values(client)
    response = client.post("/v1/completions", json={"model": "t5", "prompt": "a", "max_tokens": 5})
    generated = response.json()["usage"]["completion_tokens"]
    client.post("/v1/completions", json={"model": "t5", "prompt": 7})  # a 400
    after = metric_values(client)

    def grew(key: tuple[str, str]) -> float:
        return after[key] - before.get(key, 0.0)

    assert grew(("ordinal_requests_total", "200")) >= 2  # the completion and the first scrape
    assert grew(("ordinal_requests_total", "400")) == 1
    assert grew(("ordinal_generated_tokens_total", "t5")) == generated
    assert grew(("ordinal_time_to_first_token_seconds_count", "t5")) == 1
    assert grew(("ordinal_inter_token_latency_seconds_count", "t5")) == generated - 1
    assert after[("ordinal_queue_depth", "t5")] == 0
    assert after[("ordinal_running_batch_size", "t5")] == 0


def test_tokenize(client: httpx.Client, server: Running) -> None:
    tokenizer = server.service.models["alibi"].tokenizer
    text = "Fair is foul 🎭"
    body = client.post("/v1/tokenize", json={"model": "alibi", "prompt": text}).json()
    assert body["tokens"] == encode_prompt(tokenizer, text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 4 * CONTEXT_LENGTH
    bare = client.post("/v1/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == body["tokens"][1:] and bare["model"] == "rope"
    assert tokenizer.decode(bare["tokens"]) == text


def test_settings_come_from_flags_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORDINAL_MODELS", "rope, alibi")
    monkeypatch.setenv("ORDINAL_MAX_BATCH_SIZE", "3")
    monkeypatch.setenv("ORDINAL_MAX_QUEUE", "5")
    monkeypatch.setenv("ORDINAL_API_KEY", "from-env")
    settings = Settings()
    assert settings.models == ["rope", "alibi"]
    assert (settings.max_batch_size, settings.max_queue) == (3, 5)
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "from-env"

    args = build_parser().parse_args(["serve", "--max-batch-size", "7", "--cors-origins", "a,b"])
    settings = settings_from_args(args)
    assert settings.max_batch_size == 7  # the flag wins
    assert settings.max_queue == 5  # the environment, where no flag is given
    assert settings.cors_origins == ["a", "b"]


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--max-batch-size", "0"), ("--device", "tpu"), ("--port", "http"), ("--max-context", "1")],
)
def test_bad_settings_name_the_field(flag: str, value: str) -> None:
    args = build_parser().parse_args(["serve", flag, value])
    with pytest.raises(ValueError, match=flag.removeprefix("--").replace("-", "_")):
        settings_from_args(args)


def test_serve_fails_fast_on_a_missing_folder_or_model(
    tmp_path: Path, checkpoints: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--checkpoints", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["serve", "--checkpoints", str(checkpoints), "--models", "rope,gpt"]) == 2
    assert "['gpt']" in capsys.readouterr().err
    command = ["serve", "--checkpoints", str(checkpoints), "--default-model", "t5"]
    assert main([*command, "--models", "rope"]) == 2
    assert "default_model 't5'" in capsys.readouterr().err


def test_every_setting_has_a_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {action.dest for action in parser._actions} - {"help"}
    assert flags == set(Settings.model_fields)
