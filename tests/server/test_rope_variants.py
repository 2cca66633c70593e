"""Rope's context-extension variants served on the same weights: listed with their scaling and
answering on their own engines (that they copy no weight: tests/server/engine/test_loader.py)."""

from __future__ import annotations

from pathlib import Path

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
