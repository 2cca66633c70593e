"""Chat templates as a hostile checkpoint brings them: each bomb is refused by the bounded
sandbox (``model.chat``), off the API's event loop, with a 400 that says what went wrong — within
a second, never a 500, and the server serves the next request."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest

from model.chat import TOKENIZER_CONFIG_FILE
from tests.server.conftest import running_server, test_settings

BOMBS = {
    "range": ("{% for i in range(10**6) %}x{% endfor %}", "range"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed"),
    "repeat": ("{{ 'x' * 10**7 }}", "10,000,000 items"),
    "power": ("{% set n = 10 ** 8 %}{{ 10 ** n }}", "bits"),
    "loops": (
        "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
        "longer than",
    ),
    "output": ("{% for i in range(99999) %}{{ 'y' * 99 }}{% endfor %}", "output passed"),
}


@pytest.fixture(scope="module")
def bombs(checkpoints: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bombs")
    for name, (template, _) in BOMBS.items():
        shutil.copytree(checkpoints / "rope", folder / name)
        (folder / name / TOKENIZER_CONFIG_FILE).write_text(json.dumps({"chat_template": template}))
    shutil.copytree(checkpoints / "rope", folder / "rope")
    return folder


def test_each_template_bomb_is_a_400_within_a_second(bombs: Path) -> None:
    settings = test_settings(bombs)
    with running_server(settings) as running, httpx.Client(base_url=running.url) as client:
        chat = {"messages": [{"role": "user", "content": "What light?"}], "max_tokens": 2}
        for name, (_, says) in BOMBS.items():
            started = time.monotonic()
            response = client.post("/v1/chat/completions", json={**chat, "model": name})
            took = time.monotonic() - started
            assert response.status_code == 400, (name, response.text)
            error = response.json()["error"]
            assert error["param"] == "messages" and says in error["message"], (name, error)
            assert took < 1.0, (name, took)
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        ok = client.post("/v1/chat/completions", json={**chat, "model": "rope"})
        assert ok.status_code == 200
