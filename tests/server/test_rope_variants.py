"""Rope's context-extension variants served on the same weights: listed with their scaling and
answering on their own engines (that they copy no weight: tests/server/engine/test_loader.py);
every scheme and every variant decodes to its context limit, alone and beside other streams,
without the engine stalling or restarting."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.api.settings import Settings
from server.messages import parse_rope_variant
from tests.server.conftest import CONTEXT_LENGTH, running_server, test_settings

VARIANTS = ["yarn4", "dynamic2", "linear2", "ntk4"]


def test_variants_share_the_weights_and_answer_on_their_own(checkpoints: Path) -> None:
    settings = test_settings(checkpoints, models=["rope", "alibi"], rope_variants=VARIANTS)
    with (
        running_server(settings) as running,
        httpx.Client(base_url=running.url, timeout=60) as client,
    ):
        listed = {entry["id"]: entry for entry in client.get("/v1/models").json()["data"]}
        assert set(listed) == {"rope", "alibi", *(f"rope+{v}" for v in VARIANTS)}  # not alibi
        assert listed["rope+yarn4"]["positional"]["scaling"] == "yarn"
        assert listed["rope+yarn4"]["positional"]["scaling_factor"] == 4.0
        assert listed["rope"]["positional"].get("scaling") is None

        long_prompt = list(range(5, 5 + 2 * CONTEXT_LENGTH))  # past the trained length
        body = {"prompt": long_prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        texts = {
            name: client.post("/v1/completions", json={**body, "model": name}).json()
            for name in ("rope", "rope+yarn4", "rope+linear2")
        }
        answers = {name: reply["choices"][0]["text"] for name, reply in texts.items()}
        assert len(set(answers.values())) > 1, answers  # the scalings change what is computed
        assert client.get("/health").json()["models"]["rope+ntk4"]["state"] == "ready"


@pytest.mark.parametrize("bad", ["yarn", "yarn0.5", "longrope4", "yarn4x"])
def test_a_bad_variant_is_a_settings_error(bad: str) -> None:
    with pytest.raises(ValueError, match="rope_variants"):
        Settings(rope_variants=[bad])
    with pytest.raises(ValueError, match="SCALING"):
        parse_rope_variant(bad)


def test_variants_parse_as_scaling_and_factor() -> None:
    assert parse_rope_variant("yarn4") == ("yarn", 4.0)
    assert parse_rope_variant("dynamic2.5") == ("dynamic", 2.5)
    assert Settings(rope_variants="yarn4, ntk2").rope_variants == ["yarn4", "ntk2"]


def _complete(url: str, model: str, prompt: list[int], limit: int) -> dict[str, Any]:
    """A greedy completion of ``prompt`` (ids, taken as they are) to ``limit`` tokens in all."""
    room = limit - len(prompt)
    body = {"model": model, "prompt": prompt, "max_tokens": room, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=60) as client:
        reply = client.post("/v1/completions", json={**body, "temperature": 0})
    assert reply.status_code == 200, (model, reply.text)
    answer = reply.json()
    assert answer["choices"][0]["finish_reason"] == "length", (model, answer)
    assert answer["usage"]["total_tokens"] == limit, (model, answer["usage"])
    return answer


def test_every_scheme_and_variant_decodes_to_its_context_limit_alone_and_beside_streams(
    checkpoints: Path,
) -> None:
    """Each model decodes from a short prompt to its context limit alone; then every model at
    once runs three streams: a prompt past the trained length to the limit, a short prompt to
    the limit, and a short neighbour. rope+dynamic2 rebuilt its rotation table twice as long
    at every step past the trained length and hung the engine (the watchdog killed it): a
    stall of 2 s here fails the streams with engine_restarting."""
    settings = test_settings(
        checkpoints, rope_variants=VARIANTS, engine_stall_timeout=2.0, max_batch_size=4
    )
    with running_server(settings) as running:
        engine = running.service.engine
        assert engine is not None and engine.pid is not None
        first = engine.pid
        limits = {name: served.max_context for name, served in running.service.models.items()}
        assert {f"rope+{variant}" for variant in VARIANTS} <= set(limits)
        assert all(limit > CONTEXT_LENGTH for limit in limits.values())  # past the trained L
        short, past = [5, 6, 7], list(range(5, 5 + CONTEXT_LENGTH + 7))
        for name, limit in limits.items():
            _complete(running.url, name, short, limit)
        jobs = [
            (name, prompt, limit if full else len(prompt) + 8)
            for name, limit in limits.items()
            for prompt, full in ((past, True), (short, True), (short, False))
        ]
        with ThreadPoolExecutor(len(jobs)) as pool:
            list(pool.map(lambda job: _complete(running.url, *job), jobs))
        assert engine.pid == first  # never restarted
        assert httpx.get(f"{running.url}/health").status_code == 200
