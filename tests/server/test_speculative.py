"""``ordinal serve --speculative ngram`` end to end: /v1/models says how each model decodes,
a stream's text is the text the server gives without it, greedy and seeded, and /metrics
counts vLLM's speculative-decoding counters; bad settings are refused naming the setting."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import httpx
import pytest

from model import kernels
from server.api.app import settings_from_args
from tests.server.conftest import TEXT, running_server, test_settings

pytestmark = pytest.mark.skipif(
    kernels.active() is None, reason="speculation needs the CPU decode kernel"
)

# A line said three times: the tiny models' own text repeats it often enough to keep drafts.
PROMPT = (TEXT[0][:16] + "\n") * 3


def counter(metrics: str, name: str) -> float:
    match = re.search(rf'^ordinal_{name}_total{{model_name="rope"}} (\S+)$', metrics, re.M)
    assert match, name
    return float(match[1])


def texts(client: httpx.Client) -> list[str]:
    """The rope model's greedy and seeded completions of PROMPT, the second streamed."""
    answers = []
    for body in ({"temperature": 0}, {"temperature": 0.8, "seed": 3, "stream": True}):
        request = {"model": "rope", "prompt": PROMPT, "max_tokens": 48, "ignore_eos": True}
        if body.get("stream"):
            with client.stream("POST", "/v1/completions", json={**request, **body}) as response:
                assert response.status_code == 200
                chunks = [line for line in response.iter_lines() if line.startswith("data: {")]
            answers.append("".join(re.findall(r'"text":"((?:[^"\\]|\\.)*)"', "".join(chunks))))
        else:
            response = client.post("/v1/completions", json={**request, **body})
            assert response.status_code == 200, response.text
            answers.append(response.json()["choices"][0]["text"])
    return answers


def test_speculation_serves_the_same_text_and_counts_its_drafts(checkpoints: Path) -> None:
    answers, described = {}, {}
    for mode in ("off", "ngram"):
        settings = test_settings(
            checkpoints, models=["rope"], speculative=mode, prompt_lookup_min=1
        )
        with (
            running_server(settings) as running,
            httpx.Client(base_url=running.url, timeout=60) as client,
        ):
            (model,) = client.get("/v1/models").json()["data"]
            described[mode] = model["speculative"]
            answers[mode] = texts(client)
            metrics = client.get("/metrics").text
        drafts = counter(metrics, "spec_decode_num_draft_tokens")
        kept = counter(metrics, "spec_decode_num_accepted_tokens")
        assert (drafts > 0) == (mode == "ngram")
        assert 0 <= kept <= drafts and counter(metrics, "spec_decode_num_drafts") <= drafts
    assert described == {"off": None, "ngram": "ngram, up to 3 tokens"}
    assert answers["ngram"] == answers["off"]
    assert kept > 0


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"speculative": "eagle"}, "speculative"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_max": 2, "prompt_lookup_min": 3}, "prompt_lookup_min"),
    ],
)
def test_bad_speculation_settings_name_the_setting(flags: dict, named: str) -> None:
    with pytest.raises(ValueError, match=rf"^{named}: "):
        settings_from_args(argparse.Namespace(**flags))
