"""Structured outputs and tool calls through OpenAI's own client against a real server (tiny
random checkpoints: their free text is noise, so whatever validates was made so by the mask):
``beta.chat.completions.parse`` with a pydantic model on three schemes, ``choice`` and
``regex`` over 50 seeds, a grammar llguidance rejects as a 400 naming the field,
``responses.create`` with ``text.format``, tools (required, named, auto), and the trace's
``grammar`` stage."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from model.grammar import GrammarMatcher, grammar_of, grammar_tokenizer
from tests.server.conftest import Running
from tests.server.conftest import openai_client as client_of

SCENE = [{"role": "user", "content": "Now is the winter of our discontent."}]
CHOICES = ["To be", "not to be", "all the world"]
PATTERN = r"[A-Z][a-z]{1,5} (is|was) (fair|foul)\."
SEEDS = range(0, 56, 8)  # 7 requests of n = 8: seeds 0..55, each choice j with seed + j


class Verdict(BaseModel):
    word: str = Field(max_length=5)
    count: int = Field(ge=0, le=9)
    fair: bool


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "clock", "parameters": TIME}},
]


@pytest.mark.parametrize("model", ["rope", "alibi", "t5"])
def test_parse_with_a_pydantic_model_returns_json_that_validates(
    server: Running, model: str
) -> None:
    completion = client_of(server).beta.chat.completions.parse(
        model=model,
        messages=SCENE,  # type: ignore[arg-type]
        response_format=Verdict,
        max_completion_tokens=80,
        temperature=1.0,
        seed=3,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Verdict)
    assert Verdict.model_validate_json(choice.message.content or "") == choice.message.parsed


def _texts(server: Running, **body: Any) -> list[str]:
    """Every choice of one request per seed in SEEDS, sent together (they share batches)."""
    client = client_of(server)

    def one(seed: int) -> list[str]:
        answer = client.completions.create(
            model="rope", prompt="Fair is", n=8, seed=seed, max_tokens=24, **body
        )
        assert {choice.finish_reason for choice in answer.choices} == {"stop"}
        return [choice.text for choice in answer.choices]

    with ThreadPoolExecutor(4) as pool:  # 32 jobs in flight: within the queue's 40
        return [text for texts in pool.map(one, SEEDS) for text in texts]


def test_choice_and_regex_outputs_always_match_over_50_seeds(server: Running) -> None:
    chosen = _texts(server, extra_body={"structured_outputs": {"choice": CHOICES}})
    assert len(chosen) >= 50 and set(chosen) <= set(CHOICES)
    assert len(set(chosen)) > 1  # the seeds draw, the mask only restricts
    matched = _texts(server, extra_body={"guided_regex": PATTERN})
    assert all(re.fullmatch(PATTERN, text) for text in matched), matched
    assert len(set(matched)) > 10


def test_chat_takes_vllm_constraints_too(server: Running) -> None:
    reply = client_of(server).chat.completions.create(
        model="alibi",
        messages=SCENE,  # type: ignore[arg-type]
        max_completion_tokens=24,
        extra_body={"structured_outputs": {"regex": PATTERN}, "seed": 5},
    )
    assert re.fullmatch(PATTERN, reply.choices[0].message.content or "")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
        ({"guided_json": {"type": "strin"}}, "guided_json"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "minProperties": 2.5},
                    },
                }
            },
            "response_format.json_schema.schema",
        ),
    ],
)
def test_what_llguidance_rejects_is_a_400_naming_the_field(
    server: Running, body: dict[str, Any], field: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client_of(server).chat.completions.create(
            model="rope",
            messages=SCENE,  # type: ignore[arg-type]
            max_completion_tokens=4,
            extra_body=body,
        )
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["message"].startswith(f"{field}: ")
    assert error["param"] == field.split(".")[0]


def test_two_constraints_at_once_are_a_400(server: Running) -> None:
    with pytest.raises(openai.BadRequestError, match="already constrained"):
        client_of(server).completions.create(
            model="rope",
            prompt="To be",
            extra_body={"guided_regex": "a+", "structured_outputs": {"choice": ["b"]}},
        )


def test_responses_text_format_json_schema_gives_valid_json(server: Running) -> None:
    client = client_of(server)
    form: Any = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    response = client.responses.create(
        model="t5",
        input="Whither goest thou?",
        text={"format": form},
        max_output_tokens=60,
        extra_body={"seed": 2},
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), WEATHER)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"
    streamed = client.responses.create(
        model="t5",
        input="Whither goest thou?",
        text={"format": form},
        max_output_tokens=60,
        stream=True,
        extra_body={"seed": 2},
    )
    deltas = "".join(e.delta for e in streamed if e.type == "response.output_text.delta")
    assert deltas == response.output_text


def _call(server: Running, tool_choice: Any, seed: int = 1, **extra: Any) -> Any:
    return client_of(server).chat.completions.create(
        model="rope",
        messages=SCENE,  # type: ignore[arg-type]
        tools=TOOLS,
        tool_choice=tool_choice,
        max_completion_tokens=60,
        seed=seed,
        **extra,
    )


def test_a_named_tool_is_called_with_arguments_that_validate(server: Running) -> None:
    choice = _call(server, {"type": "function", "function": {"name": "weather"}}).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    chunks = list(_call(server, {"type": "function", "function": {"name": "weather"}}, stream=True))
    deltas = [d for chunk in chunks for d in chunk.choices[0].delta.tool_calls or []]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_calls_one_of_the_tools_with_its_schema(server: Running) -> None:
    schemas = {"weather": WEATHER, "clock": TIME}
    names = set()
    for seed in range(4):
        choice = _call(server, "required", seed=seed).choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        names.add(call.function.name)
    assert names == set(schemas)  # the seeds reach both tools
    streamed = list(_call(server, "required", seed=0, stream=True))
    (call_delta,) = [d for chunk in streamed for d in chunk.choices[0].delta.tool_calls or []]
    first = _call(server, "required", seed=0).choices[0].message.tool_calls[0]
    assert (call_delta.function.name, call_delta.function.arguments) == (
        first.function.name,
        first.function.arguments,
    )


def test_auto_is_a_400_and_none_ignores_the_tools(server: Running) -> None:
    for tool_choice in ("auto", openai.NOT_GIVEN):
        with pytest.raises(openai.BadRequestError, match="cannot decide"):
            _call(server, tool_choice)
    reply = _call(server, "none").choices[0]
    assert reply.message.tool_calls is None and reply.finish_reason in ("stop", "length")


def test_the_trace_shows_the_grammar_stage_the_sampler_applies(server: Running) -> None:
    body = {"prompt": "Fair is", "model": "t5", "top": 400, "temperature": 0.7}
    stages = {
        s["name"]: s
        for s in httpx.post(
            f"{server.url}/v1/trace",
            json={**body, "structured_outputs": {"choice": CHOICES}},
            timeout=30,
        ).json()["next_token"]["stages"]
    }
    assert list(stages)[:2] == ["logits", "grammar"]
    served = server.service.models["t5"]
    matcher = GrammarMatcher(
        grammar_tokenizer(served.tokenizer, served.eos), grammar_of("choice", CHOICES)
    )
    bits = int.from_bytes(matcher.allowed(), "little")
    allowed = {token for token in range(served.vocab) if bits >> token & 1}
    grammar = {entry["id"]: entry["prob"] for entry in stages["grammar"]["top"]}
    assert set(grammar) == allowed and stages["grammar"]["kept"] == len(allowed)
    raw = {entry["id"]: entry["prob"] for entry in stages["logits"]["top"]}
    mass = sum(raw[token] for token in allowed)  # top 400 ≥ the vocabulary: every token listed
    assert all(grammar[t] == pytest.approx(raw[t] / mass, rel=1e-4) for t in allowed)
