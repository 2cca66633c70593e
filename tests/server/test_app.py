"""Readiness, /v1/models, /metrics, /v1/tokenize, and settings from flags and the environment."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import model.cpu as cpu
from model import captured
from model.checkpoint import WEIGHTS_FILE, load_checkpoint
from model.positional import SCHEMES, TABLE_SCHEMES
from model.tokenizer import encode_prompt
from ordinal import build_parser, main, serve_options
from server.api.app import settings_from_args
from server.api.metrics import FAILURE_REASONS
from server.api.settings import Settings
from tests.server.conftest import (
    CONTEXT_LENGTH,
    MAX_POSITIONS,
    SCHEME_SETTINGS,
    Running,
    running_server,
    test_settings,
    wait_for,
)


def test_health_is_503_until_the_models_are_loaded(checkpoints: Path) -> None:
    settings = test_settings(checkpoints, models=["rope"])
    with (
        running_server(settings, wait_ready=False, hold_loading=True) as running,
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
        running.control.call("release_loading")
        wait_for(lambda: running.service.ready, "the models to load", timeout=300)
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
        # The scheme's own kind and claim (the playground's note), from its class.
        assert entry["kind"] == SCHEMES[name].kind == stored.positional.kind
        assert entry["claim"] == SCHEMES[name].claim
        # Every scheme declares what the CPU kernel computes for it: the kernel decodes each
        # that names a bias, with the variant this process chose (model.backend;
        # ORDINAL_CPU_ISA=torch: none), and the torch blocks the others (irope, PoPE, ...).
        isa = cpu.chosen()
        on_kernel = isa and SCHEMES[name].kernel_bias is not None
        assert entry["decode_backend"] == ("cpu-kernel" if on_kernel else "torch")
        assert entry["cpu_isa"] == (isa if on_kernel else None)
    assert listed["binary"]["max_positions"] == 2**8
    assert listed["rope"]["max_positions"] is None


def metric_values(client: httpx.Client) -> dict[tuple[str, str], float]:
    """(sample name, label values joined) → value, from /metrics."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    values = {}  # labels in the exposition's (alphabetical) order
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            values[(sample.name, ",".join(sample.labels.values()))] = sample.value
    return values


def test_metrics_count_a_scripted_mix_of_requests(
    server: Running, client: httpx.Client, gate: Any
) -> None:
    """Every metric of the vLLM-style set moves by exactly what a known mix of requests did:
    two that end by length (one generating, one only scoring its prompt), one by a stop string,
    one whose client leaves, one 400 — and probes and scrapes counted under their own routes."""
    model, url = "t5", "/v1/completions"
    before = metric_values(client)
    plain = {"model": model, "prompt": "To be", "max_tokens": 6, "temperature": 0, "seed": 1}
    greedy = client.post(url, json={**plain, "ignore_eos": True}).json()
    text = greedy["choices"][0]["text"]
    stop = next(text[i : i + 2] for i in range(1, len(text) - 1) if text[i : i + 2].strip())
    stopped = client.post(url, json={**plain, "stop": stop}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    scored = client.post(
        url,
        json={"model": model, "prompt": "To be or", "max_tokens": 0, "echo": True, "logprobs": 1},
    ).json()
    assert client.post(url, json={**plain, "top_p": 7}).status_code == 400
    for _ in range(3):
        assert client.get("/health").status_code == 200

    engine = server.engine(model)
    held = gate(model)
    with (
        httpx.Client(base_url=server.url, timeout=0.3) as impatient,  # leaves mid-request
        pytest.raises(httpx.ReadTimeout),
    ):
        impatient.post(url, json={**plain, "prompt": "a", "max_tokens": 50})
    wait_for(lambda: engine.closing > 0, "the server to notice the client left")
    held.open()
    wait_for(lambda: engine.in_flight == 0, "the row to be freed")
    after = metric_values(client)

    def grew(name: str, labels: str = model) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    finished = [greedy, stopped, scored]
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in finished) + 2  # + <|bos|> a
    generated = sum(r["usage"]["completion_tokens"] for r in finished)
    assert grew("ordinal_requests_total", f"{url},200") == 3
    assert grew("ordinal_requests_total", f"{url},400") == 1
    assert grew("ordinal_requests_total", "/health,200") == 3
    assert grew("ordinal_requests_total", "/metrics,200") == 1  # the first scrape
    assert grew("ordinal_prompt_tokens_total") == prompt_tokens
    assert grew("ordinal_generation_tokens_total") == generated + 1  # + the step it left in
    assert grew("ordinal_request_success_total", f"length,{model}") == 2
    assert grew("ordinal_request_success_total", f"stop,{model}") == 1
    assert grew("ordinal_request_success_total", f"abort,{model}") == 1
    assert sum(grew("ordinal_request_failures_total", f"{model},{r}") for r in FAILURE_REASONS) == 0
    for histogram, count in [
        ("ordinal_e2e_request_latency_seconds", 3),
        ("ordinal_request_decode_time_seconds", 3),
        ("ordinal_request_generation_tokens", 3),
        ("ordinal_request_queue_time_seconds", 4),
        ("ordinal_request_prompt_tokens", 4),
        ("ordinal_request_prefill_time_seconds", 3),  # the three that got a first token
        ("ordinal_time_to_first_token_seconds", 3),
    ]:
        assert grew(f"{histogram}_count") == count, histogram
    assert grew("ordinal_request_prompt_tokens_sum") == prompt_tokens
    assert grew("ordinal_request_generation_tokens_sum") == generated
    assert after[("ordinal_num_requests_waiting", model)] == 0
    assert after[("ordinal_num_requests_running", model)] == 0
    assert after[("process_cpu_seconds_total", "")] > 0


def test_tokenize(client: httpx.Client, server: Running) -> None:
    tokenizer = server.service.models["alibi"].tokenizer
    text = "Fair is foul 🎭"
    body = client.post("/v1/tokenize", json={"model": "alibi", "prompt": text}).json()
    assert body["tokens"] == encode_prompt(tokenizer, text)
    assert body["count"] == len(body["tokens"]) and body["max_context"] == 4 * CONTEXT_LENGTH
    bare = client.post("/v1/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == body["tokens"][1:] and bare["model"] == "rope"
    assert tokenizer.decode(bare["tokens"]) == text


def test_auto_tokenizer_on_a_saved_checkpoint_gives_the_servers_ids(
    client: httpx.Client, checkpoints: Path
) -> None:
    """A checkpoint written by ``save_checkpoint`` (training's and import's save) encodes under
    Hugging Face's ``AutoTokenizer`` to the ids the server prompts with: <|bos|> once, first."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(checkpoints / "rope")
    for text in ("To be, or not to be", "Ça va, naïve café — ¿sí? 🎭", "  spaced  "):
        served = client.post("/v1/tokenize", json={"model": "rope", "prompt": text}).json()
        assert hf(text)["input_ids"] == served["tokens"], text
        assert served["tokens"].count(hf.bos_token_id) == 1


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
    serve_options(parser)
    flags = {action.dest for action in parser._actions} - {"help"}
    assert flags == set(Settings.model_fields)


def test_a_broken_chat_template_fails_its_model_alone(checkpoints: Path, tmp_path: Path) -> None:
    """The API process reads the tokenizer config (the engine does not): a broken one fails that
    model, and the engine is not restarted for it."""
    for name in ("rope", "none"):
        shutil.copytree(checkpoints / name, tmp_path / name)
    (tmp_path / "none" / "tokenizer_config.json").write_text("[not json")
    with (
        running_server(test_settings(tmp_path)) as running,
        httpx.Client(base_url=running.url, timeout=30) as client,
    ):
        engine = running.service.engine
        assert engine is not None and engine.process is not None
        first_engine = engine.process.pid
        states = client.get("/health").json()["models"]
        assert states["rope"]["state"] == "ready"
        assert states["none"]["state"] == "failed"
        assert "tokenizer_config.json" in states["none"]["message"]
        assert str(tmp_path) not in states["none"]["message"]
        body = {"model": "rope", "prompt": "To be", "max_tokens": 3}
        assert client.post("/v1/completions", json=body).status_code == 200
        response = client.post("/v1/completions", json={**body, "model": "none"})
        assert response.status_code == 503
        assert engine.process is not None and engine.process.pid == first_engine  # no restart


def test_cuda_graphs_are_one_setting_for_the_server_and_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--cuda-graphs false`` or ``ORDINAL_CUDA_GRAPHS=0`` turns them off: the variable is the
    one model.captured reads for offline decoding too."""
    cuda = torch.device("cuda")
    assert Settings().cuda_graphs and captured.wanted(cuda)
    monkeypatch.setenv(captured.SWITCH, "0")
    assert not Settings().cuda_graphs and not captured.wanted(cuda)
    args = build_parser().parse_args(["serve", "--cuda-graphs", "true"])
    assert settings_from_args(args).cuda_graphs  # the flag wins
