"""POST /v1/chat/completions, driven by OpenAI's own Python client: a conversation is a scene,
the reply is the next speech, streamed or not, and never runs into another speaker's line."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from model.chat import TOKENIZER_CONFIG_FILE
from tests.server.conftest import Running, running_server, test_settings
from tests.server.conftest import openai_client as client_of

SHIPPED = Path(__file__).resolve().parents[2] / "checkpoints"
SCENE = [
    {"role": "system", "content": "A street in Verona."},
    {"role": "user", "content": "Good morrow, cousin.", "name": "Benvolio"},
    {"role": "assistant", "content": "Is the day so young?"},
    {"role": "user", "content": "But new struck nine."},
]
SPEAKER_LINE = re.compile(r"^[A-Z][A-Z' .-]*:$", re.M)


def test_chat_with_the_openai_client(server: Running) -> None:
    client = client_of(server)
    reply = client.chat.completions.create(
        model="rope",
        messages=SCENE,
        max_tokens=12,
        seed=3,
        temperature=0.9,  # type: ignore[arg-type]
    )
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert reply.usage is not None and reply.usage.completion_tokens <= 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    stream = client.chat.completions.create(
        model="rope",
        messages=SCENE,  # type: ignore[arg-type]
        max_tokens=12,
        seed=3,
        temperature=0.9,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # seeded: the stream says what the answer said
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [choice.finish_reason]
    assert chunks[-1].usage is not None
    # the same counts; the stream reused the answer's prompt from the prefix cache
    details = {"prompt_tokens_details"}
    streamed, answered = chunks[-1].usage, reply.usage
    assert streamed.model_dump(exclude=details) == answered.model_dump(exclude=details)
    assert streamed.prompt_tokens_details is not None
    assert streamed.prompt_tokens_details.cached_tokens > 0


def test_chat_logprobs_name_each_token_with_its_bytes(server: Running) -> None:
    reply = client_of(server).chat.completions.create(
        model="alibi",
        messages=SCENE,  # type: ignore[arg-type]
        max_tokens=6,
        seed=1,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    for entry in content:
        assert bytes(entry.bytes or []).decode("utf-8", "replace")  # the token's own bytes
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6


def test_completions_with_the_openai_client(server: Running) -> None:
    client = client_of(server)
    body: dict[str, Any] = {"model": "t5", "prompt": "To be", "max_tokens": 8, "seed": 2}
    answer = client.completions.create(**body)
    assert answer.object == "text_completion"
    streamed = "".join(
        chunk.choices[0].text for chunk in client.completions.create(**body, stream=True)
    )
    assert streamed == answer.choices[0].text


def test_a_developer_message_is_a_system_one_and_content_parts_join(server: Running) -> None:
    def prompt_tokens(messages: list[dict[str, Any]]) -> int:
        reply = client_of(server).chat.completions.create(
            model="rope",
            messages=messages,
            max_tokens=1,  # type: ignore[arg-type]
        )
        assert reply.usage is not None
        return reply.usage.prompt_tokens

    system = prompt_tokens([{"role": "system", "content": "Verona."}, SCENE[3]])
    parts = [{"type": "text", "text": "Ver"}, {"type": "text", "text": "ona."}]
    assert prompt_tokens([{"role": "developer", "content": parts}, SCENE[3]]) == system


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "name": "R2-D2"}]}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]},
            "messages",
        ),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": 10**6}, "max_completion_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "gpt-5"}, "model"),
        ({"messages": [{"role": "user", "content": "x" * 3000}]}, "messages"),  # past the context
    ],
)
def test_bad_chat_requests_are_4xx_naming_the_field(
    client: httpx.Client, change: dict[str, Any], param: str
) -> None:
    body = json.dumps({"messages": SCENE[3:], **change}).encode()
    response = client.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert param in error["message"] or response.status_code == 404


def test_a_checkpoint_template_refusing_a_conversation_is_a_400(
    checkpoints: Path, tmp_path: Path
) -> None:
    shutil.copytree(checkpoints / "rope", tmp_path / "rope")
    refusing = "{% if messages[0].role == 'system' %}{{ raise_exception('no chorus') }}{% endif %}"
    (tmp_path / "rope" / TOKENIZER_CONFIG_FILE).write_text(json.dumps({"chat_template": refusing}))
    with running_server(test_settings(tmp_path)) as running:
        response = httpx.post(
            f"{running.url}/v1/chat/completions", json={"messages": SCENE}, timeout=30
        )
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "messages"
        assert "no chorus" in response.json()["error"]["message"]


@pytest.fixture(scope="module")
def shipped_rope() -> Iterator[Running]:
    settings = test_settings(SHIPPED, models=["rope"])
    with running_server(settings) as running:
        yield running


def test_a_reply_never_contains_the_next_speakers_line(shipped_rope: Running) -> None:
    """The trained model, many seeds: each reply is one speech — it ends at <|eos|> or before
    another speaker's line, never with one inside it."""
    client = client_of(shipped_rope)
    reasons = []
    for seed in range(12):
        reply = client.chat.completions.create(
            model="rope",
            messages=SCENE,
            max_tokens=80,
            seed=seed,
            temperature=1.0,  # type: ignore[arg-type]
        )
        text = reply.choices[0].message.content or ""
        assert not SPEAKER_LINE.search(text), (seed, text)
        assert not any(f"{name}:" in text for name in ("ROMEO", "JULIET", "BENVOLIO", "CHORUS"))
        reasons.append(reply.choices[0].finish_reason)
    assert "stop" in reasons  # speeches end by themselves
