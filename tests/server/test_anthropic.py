"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` driven by Anthropic's own SDK, unchanged
but for its ``base_url``: the same greedy conversation through chat and through Messages gives
the same text (both are the one scene), streamed or not; the stream is Anthropic's event
sequence; usage counts the prompt as chat and count_tokens do, split between computed and
cached tokens; stop reasons, tool use, and bad input as Anthropic-shaped 4xx naming the field."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import orjson
import pytest

from tests.server.conftest import Running, running_server, test_settings
from tests.server.conftest import openai_client as openai_of
from tests.server.test_structured import TIME, WEATHER

SYSTEM = "Verona, a public place."
QUESTION = "What light breaks?"
# The SDK's create() no longer names temperature, top_k or top_p (Anthropic's newest models take
# none): a client sends them in extra_body, as these tests do.
GREEDY = {"temperature": 0.0}
CUT = {"ignore_eos": True}  # it runs to max_tokens


def sdk_of(running: Running, api_key: str = "unused") -> anthropic.Anthropic:
    """Anthropic's client pointed at ``running`` (no retries: a failure shows at once)."""
    return anthropic.Anthropic(base_url=running.url, api_key=api_key, max_retries=0)


def chat(server: Running, max_tokens: int, **extra: Any) -> Any:
    """The same conversation through OpenAI's chat completions."""
    return openai_of(server).chat.completions.create(
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_tokens=max_tokens,
        model="rope",
        extra_body={**GREEDY, **extra},
    )


def create(server: Running, max_tokens: int, body: dict[str, Any] = CUT, **extra: Any) -> Any:
    """A greedy Messages request of the same conversation (``body``: its extra_body)."""
    return sdk_of(server).messages.create(
        model="rope",
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=max_tokens,
        extra_body={**GREEDY, **body},
        **extra,
    )


def count(server: Running) -> int:
    counted = sdk_of(server).messages.count_tokens(
        model="rope", system=SYSTEM, messages=[{"role": "user", "content": QUESTION}]
    )
    return counted.input_tokens


def test_create_answers_as_chat_does_and_counts_as_it_does(server: Running) -> None:
    reply = chat(server, 12, **CUT)
    assert reply.usage is not None
    message = create(server, 12)
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == "rope"
    (block,) = message.content
    assert block.type == "text" and block.text == reply.choices[0].message.content
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    usage = message.usage
    assert usage.output_tokens == reply.usage.completion_tokens == 12
    prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert prompt == reply.usage.prompt_tokens == count(server)


def test_a_prompt_sent_again_is_read_from_the_cache_and_counted_so(server: Running) -> None:
    create(server, 2)
    usage = create(server, 2).usage
    assert usage.cache_read_input_tokens is not None and usage.cache_read_input_tokens >= 16
    assert usage.input_tokens + usage.cache_read_input_tokens == count(server)
    assert usage.cache_creation_input_tokens == 0


def test_the_stream_is_anthropics_event_sequence(server: Running) -> None:
    expected = chat(server, 12, **CUT).choices[0].message.content
    events = list(
        sdk_of(server).messages.create(
            system=SYSTEM,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=12,
            stream=True,
            model="rope",
            extra_body={**GREEDY, **CUT},
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start = events[0].message  # type: ignore[union-attr]
    assert start.content == [] and start.stop_reason is None
    assert events[1].content_block.type == "text"  # type: ignore[union-attr]
    deltas = [event.delta for event in events[2:-3]]  # type: ignore[union-attr]
    assert {delta.type for delta in deltas} == {"text_delta"}
    assert "".join(delta.text for delta in deltas) == expected
    delta = events[-2]
    assert delta.delta.stop_reason == "max_tokens"  # type: ignore[union-attr]
    assert delta.usage.output_tokens == 12  # type: ignore[union-attr]
    assert {event.index for event in events[1:-2]} == {0}  # type: ignore[union-attr]


def test_the_sdks_stream_helper_gives_the_same_message(server: Running) -> None:
    expected = create(server, 12)
    with sdk_of(server).messages.stream(
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=12,
        model="rope",
        extra_body={**GREEDY, **CUT},
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected.content[0].text
    assert [(block.type, block.text) for block in final.content] == [("text", text)]  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == count(server)


def test_a_stop_sequence_ends_the_reply_and_is_named(server: Running) -> None:
    seeded = {"temperature": 0.8, "seed": 0, "ignore_eos": True}  # more varied than greedy
    text = create(server, 16, seeded).content[0].text
    # two characters well inside the reply (not a broken UTF-8 character's replacement)
    sequence = next(
        text[i : i + 2] for i in range(3, len(text) - 1) if "\ufffd" not in text[i : i + 2]
    )
    message = create(server, 16, seeded, stop_sequences=["unmatched zzz", sequence])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == sequence
    assert message.content[0].text == text[: text.index(sequence)]
    assert message.usage.output_tokens < 16


def test_the_end_of_a_speech_is_end_turn(server: Running) -> None:
    eos = server.service.models["rope"].eos
    message = create(server, 16, {"logit_bias": {str(eos): 100}})
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.content[0].text == "" and message.usage.output_tokens == 1


def test_system_blocks_and_a_system_message_are_the_scene_chat_renders(server: Running) -> None:
    expected = chat(server, 8, **CUT).choices[0].message.content
    for system, messages in [
        ([{"type": "text", "text": SYSTEM[:20]}, {"type": "text", "text": SYSTEM[20:]}], []),
        (None, [{"role": "system", "content": SYSTEM}]),
    ]:
        body = {
            "model": "rope",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [
                *messages,
                {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
            ],
        }
        if system is not None:
            body["system"] = system
        answer = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["content"][0]["text"] == expected


TOOLS: list[Any] = [
    {"name": "weather", "description": "the forecast", "input_schema": WEATHER},
    {"name": "clock", "input_schema": TIME},
]


def use_tool(server: Running, tool_choice: Any, seed: int = 1, **extra: Any) -> Any:
    return sdk_of(server).messages.create(
        model="rope",
        messages=[{"role": "user", "content": "Now is the winter of our discontent."}],
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=60,
        extra_body={"temperature": 0.8, "seed": seed},
        **extra,
    )


def test_a_named_tool_is_used_with_input_that_validates(server: Running) -> None:
    message = use_tool(server, {"type": "tool", "name": "weather"})
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "weather" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, WEATHER)
    with sdk_of(server).messages.stream(
        model="rope",
        messages=[{"role": "user", "content": "Now is the winter of our discontent."}],
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "weather"},
        max_tokens=60,
        extra_body={"temperature": 0.8, "seed": 1},
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (streamed,) = final.content
    assert streamed.type == "tool_use" and streamed.input == block.input  # type: ignore[union-attr]
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"]  # type: ignore[union-attr]
    assert len(partial) > 1 and json.loads("".join(partial)) == block.input  # it streamed


def test_any_uses_one_of_the_tools_streamed_or_not(server: Running) -> None:
    schemas = {"weather": WEATHER, "clock": TIME}
    names = set()
    for seed in range(4):
        message = use_tool(server, {"type": "any"}, seed)
        assert message.stop_reason == "tool_use"
        (block,) = message.content
        jsonschema.validate(block.input, schemas[block.name])  # type: ignore[union-attr]
        names.add(block.name)  # type: ignore[union-attr]
    assert names == set(schemas)  # the seeds reach both tools
    events = list(use_tool(server, {"type": "any"}, 0, stream=True))
    first = use_tool(server, {"type": "any"}, 0).content[0]
    starts = [e.content_block for e in events if e.type == "content_block_start"]  # type: ignore[union-attr]
    assert [(b.type, b.name) for b in starts] == [("tool_use", first.name)]  # type: ignore[union-attr]
    (partial,) = [e.delta.partial_json for e in events if e.type == "content_block_delta"]  # type: ignore[union-attr]
    assert json.loads(partial) == first.input  # type: ignore[union-attr]


def test_tool_choice_none_answers_in_text(server: Running) -> None:
    message = use_tool(server, {"type": "none"})
    assert message.content[0].type == "text" and message.stop_reason in ("end_turn", "max_tokens")


VALID: dict[str, Any] = {
    "model": "rope",
    "max_tokens": 4,
    "messages": [{"role": "user", "content": "Hi"}],
}


@pytest.mark.parametrize(
    ("change", "field", "status"),
    [
        ({"max_tokens": None}, "max_tokens", 400),
        ({"max_tokens": 0}, "max_tokens", 400),
        ({"max_tokens": 10_000}, "max_tokens", 400),
        ({"temperature": 1.5}, "temperature", 400),
        ({"messages": []}, "messages", 400),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", 400),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content",
            400,
        ),
        ({"system": [{"type": "document", "source": {}}]}, "system", 400),
        ({"stop_sequences": [""]}, "stop_sequences", 400),
        ({"tools": TOOLS}, "tools", 400),
        ({"tools": TOOLS, "tool_choice": {"type": "auto"}}, "tool_choice", 400),
        (
            {"tools": TOOLS, "tool_choice": {"type": "tool", "name": "sundial"}},
            "tool_choice.name",
            400,
        ),
        ({"tool_choice": {"type": "any"}}, "tool_choice", 400),
        (
            {"tools": [{"name": "f", "input_schema": {"type": "string"}}]},
            "tools[0].input_schema",
            400,
        ),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking", 400),
        ({"top_k": -1}, "top_k", 400),
        ({"model": "sundial"}, "model", 404),
    ],
)
def test_bad_input_is_an_anthropic_error_naming_the_field(
    client: httpx.Client, change: dict[str, Any], field: str, status: int
) -> None:
    body = {key: value for key, value in {**VALID, **change}.items() if value is not None}
    answer = client.post("/v1/messages", json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()
    assert error["type"] == "error" and set(error) == {"type", "error"}
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    assert error["error"]["type"] == kind
    message = error["error"]["message"]
    assert message.startswith(f"{field}:") or f"'{body.get('model')}'" in message, message


def test_a_body_that_is_not_json_is_an_anthropic_400(client: httpx.Client) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        answer = client.post(
            path, content=b"{not json", headers={"Content-Type": "application/json"}
        )
        assert answer.status_code == 400
        assert answer.json()["error"]["type"] == "invalid_request_error"
    # and the OpenAI routes keep OpenAI's shape
    openai_shaped = client.post(
        "/v1/chat/completions",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
    ).json()
    assert set(openai_shaped) == {"error"} and openai_shaped["error"]["code"] == "invalid_json"


def test_the_sdk_raises_its_own_errors_with_the_message(server: Running) -> None:
    with pytest.raises(anthropic.BadRequestError, match="temperature") as raised:
        create(server, 4, {"temperature": 1.5})
    assert raised.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError, match="sundial"):
        sdk_of(server).messages.create(
            model="sundial", max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )


def failing(server: Running, seed: int, send: Callable[[], Any]) -> Any:
    """What ``send`` returns while the request seeded ``seed`` fails on its fourth draw."""
    server.control.call("failing_sampler", seed, 3)
    try:
        return send()
    finally:
        server.control.call("reset")


def test_a_stream_that_fails_midway_ends_with_an_error_event(server: Running) -> None:
    seed, url = 90210, f"{server.url}/v1/messages"
    body = {**VALID, "max_tokens": 12, "stream": True, "seed": seed, "ignore_eos": True}

    def lines() -> list[str]:
        with httpx.stream("POST", url, json=body, timeout=30) as answer:
            return [line for line in answer.iter_lines() if line]

    sent = failing(server, seed, lines)
    events = list(zip(sent[::2], sent[1::2], strict=True))
    assert events[0][0] == "event: message_start" and events[-1][0] == "event: error"
    assert "event: message_stop" not in sent
    error = orjson.loads(events[-1][1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "not affected" in error["error"]["message"]

    def streamed() -> list[Any]:
        extra = {"seed": seed, "ignore_eos": True}
        return list(sdk_of(server).messages.create(**VALID, stream=True, extra_body=extra))

    with pytest.raises(anthropic.APIStatusError, match="not affected"):  # the SDK raises it
        failing(server, seed, streamed)


@pytest.fixture(scope="module")
def keyed_server(checkpoints: Path) -> Iterator[Running]:
    settings = test_settings(checkpoints, models=["rope"], api_key="s3cret")
    with running_server(settings) as running:
        yield running


def test_the_api_key_is_taken_as_anthropics_clients_send_it(keyed_server: Running) -> None:
    message = sdk_of(keyed_server, "s3cret").messages.create(
        model="rope", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
    )
    assert message.usage.output_tokens <= 2
    url = f"{keyed_server.url}/v1/messages/count_tokens"
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    assert httpx.post(url, json=body, headers={"x-api-key": "s3cret"}).status_code == 200
    refused = httpx.post(url, json=body, headers={"x-api-key": "wrong"})
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        sdk_of(keyed_server, "wrong").messages.create(
            model="rope", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )
