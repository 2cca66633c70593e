"""``POST /v1/responses`` driven by the official openai SDK: the same conversation through chat
and through Responses gives the same text (both are the one scene), streamed or not; the
stream is the Responses event sequence; nothing is stored, so store and previous_response_id
are clear 400s."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import Running
from tests.server.conftest import openai_client as client_of

SETTINGS = {"model": "rope", "temperature": 0.8}
SEED = {"seed": 4, "ignore_eos": True}


def chat_text(server: Running, max_tokens: int) -> str:
    reply = client_of(server).chat.completions.create(
        messages=[
            {"role": "developer", "content": "Verona."},
            {"role": "user", "content": "What light through yonder window breaks?"},
        ],
        max_completion_tokens=max_tokens,
        extra_body=SEED,
        **SETTINGS,  # type: ignore[arg-type]
    )
    return reply.choices[0].message.content or ""


def test_responses_create_answers_as_chat_does(server: Running) -> None:
    response = client_of(server).responses.create(
        instructions="Verona.",
        input="What light through yonder window breaks?",
        max_output_tokens=12,
        extra_body=SEED,
        **SETTINGS,  # type: ignore[arg-type]
    )
    assert response.object == "response" and response.id.startswith("resp")
    assert response.status == "incomplete"  # ignore_eos: it ran to max_output_tokens
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == chat_text(server, 12)
    assert response.usage is not None and response.usage.output_tokens == 12
    assert response.usage.total_tokens == response.usage.input_tokens + 12
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant"


def test_responses_stream_is_the_event_sequence(server: Running) -> None:
    events = list(
        client_of(server).responses.create(
            instructions="Verona.",
            input=[{"role": "user", "content": "What light through yonder window breaks?"}],
            max_output_tokens=12,
            stream=True,
            extra_body=SEED,
            **SETTINGS,  # type: ignore[arg-type]
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas == chat_text(server, 12)
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == deltas and final.usage is not None


def test_a_conversation_passed_back_continues_it(server: Running) -> None:
    sdk = client_of(server)
    first = sdk.responses.create(input="Good morrow.", max_output_tokens=4, **SETTINGS)  # type: ignore[arg-type]
    history = [
        {"role": "user", "content": "Good morrow."},
        *[item.model_dump() for item in first.output],
    ]
    follow = sdk.responses.create(
        input=[*history, {"role": "user", "content": "Speak again."}],  # type: ignore[list-item]
        max_output_tokens=4,
        **SETTINGS,  # type: ignore[arg-type]
    )
    assert follow.usage is not None and first.usage is not None
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("store", True),
        ("previous_response_id", "resp_123"),
        ("tools", [{"type": "function", "name": "f"}]),
    ],
)
def test_what_needs_a_store_or_is_not_built_is_a_clear_400(
    client: httpx.Client, field: str, value: object
) -> None:
    answer = client.post("/v1/responses", json={"input": "Hi", field: value})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == field
    if field != "tools":
        assert "keeps no responses" in error["message"]


def test_the_sdk_raises_on_store_true(server: Running) -> None:
    with pytest.raises(openai.BadRequestError, match="store"):
        client_of(server).responses.create(input="Hi", store=True, model="rope")
