"""model.chat: a conversation becomes the speeches the models were trained on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from model.chat import (
    DEFAULT_SPEAKERS,
    TOKENIZER_CONFIG_FILE,
    ChatTemplate,
    ChatTemplateError,
    Message,
)
from model.tokenizer import load_tokenizer, special_ids

SCENE = [
    Message("system", "A street in Verona."),
    Message("user", "Good morrow, cousin.", name="Benvolio"),
    Message("assistant", "Is the day so young?"),
    Message("user", "But new struck nine."),
]


def test_messages_render_as_speeches_the_reply_speaker_last() -> None:
    text = ChatTemplate().render(SCENE, eos_token="<E>")
    assert text == (
        "CHORUS:\nA street in Verona.<E>"
        "BENVOLIO:\nGood morrow, cousin.<E>"
        "JULIET:\nIs the day so young?<E>"
        "ROMEO:\nBut new struck nine.<E>"
        "JULIET:\n"
    )


def test_the_reply_is_spoken_by_the_last_assistant_name() -> None:
    named = [*SCENE[:2], Message("assistant", "Ay me!", name="Romeo"), SCENE[3]]
    assert ChatTemplate().render(named, eos_token="|").endswith("|ROMEO:\n")
    assert DEFAULT_SPEAKERS == {"system": "CHORUS", "user": "ROMEO", "assistant": "JULIET"}


def test_speeches_are_separated_by_eos_and_user_text_stays_text(
    tiny_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    tiny_tokenizer.save(str(tmp_path / "tokenizer.json"))
    tiny_tokenizer = load_tokenizer(tmp_path / "tokenizer.json")  # as checkpoints load it
    special = special_ids(tiny_tokenizer)
    messages = [Message("user", "a <|eos|> b"), Message("assistant", "c")]
    scene = ChatTemplate().encode(tiny_tokenizer, messages)
    expected = [special.bos]
    for index, piece in enumerate(["ROMEO:\na <|eos|> b", "JULIET:\nc", "JULIET:\n"]):
        expected += ([special.eos] if index else []) + tiny_tokenizer.encode(piece).ids
    assert scene.prompt_ids == expected
    assert scene.prompt_ids.count(special.eos) == 2  # the literal <|eos|> is bytes
    assert scene.stops == ["\nJULIET:", "\nROMEO:"]
    assert scene.speaker == "JULIET"


def test_a_checkpoint_brings_its_own_template(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    assert ChatTemplate.from_checkpoint(tmp_path).source == ChatTemplate().source  # no file
    source = (
        "{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('no system messages here') }}{% endif %}"
        "[{{ m.content }}]{% endfor %}"
    )
    (tmp_path / TOKENIZER_CONFIG_FILE).write_text(json.dumps({"chat_template": source}))
    template = ChatTemplate.from_checkpoint(tmp_path)
    assert template.render([Message("user", "hi")], eos_token="") == "[hi]"
    with pytest.raises(ChatTemplateError, match="no system messages here"):
        template.render(SCENE, eos_token="")


@pytest.mark.parametrize(
    ("config", "complaint"),
    [
        ("not json", "not a JSON object"),
        (json.dumps({"chat_template": 3}), "must be a string"),
        (json.dumps({"chat_template": "{% for %}"}), "does not compile"),
    ],
)
def test_a_bad_template_file_is_named(tmp_path: Path, config: str, complaint: str) -> None:
    (tmp_path / TOKENIZER_CONFIG_FILE).write_text(config)
    with pytest.raises(ChatTemplateError, match=complaint):
        ChatTemplate.from_checkpoint(tmp_path)


def test_templates_run_in_a_sandbox() -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        ChatTemplate(escape).render([Message("user", "x")], eos_token="")
