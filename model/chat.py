"""Chat as a play: messages rendered as speeches by a Jinja chat template, as Hugging Face does.

The shipped models learned speeches — ``"SPEAKER:\\n" + lines`` — separated by ``<|eos|>``, so a
conversation becomes a scene: each message is a speech by its ``name`` (or its role's default
speaker, :data:`DEFAULT_SPEAKERS`), and the reply is the next speech, which ends where the model
ends a speech (``<|eos|>``) or where it starts the line of a speaker of the scene.

A checkpoint can bring its own template: the ``chat_template`` string of its
``tokenizer_config.json`` (Hugging Face's file and key); without one, :data:`DEFAULT_TEMPLATE`.
Templates render in Jinja's immutable sandbox (a checkpoint's template is code from whoever
made the checkpoint) and see ``messages``, ``add_generation_prompt``, ``eos_token``,
``speakers`` and ``assistant_name``; ``raise_exception(message)`` refuses a conversation.

The sandbox keeps a template from the host; :class:`BoundedSandbox` and :meth:`ChatTemplate.render`
also keep it from the host's time and memory: a rendering stops with a :class:`ChatTemplateError`
once it has taken :data:`RENDER_SECONDS` (a trace function checks the clock at every line the
template runs), once its output passes ``max_chars``, at a ``*`` that would repeat a string or list
past ``max_chars``, at a ``**`` whose result passes :data:`MAX_BITS`, at a ``range`` past
Jinja's 100,000 items, and at recursion past Python's limit.
"""

from __future__ import annotations

import json
import math
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from jinja2 import TemplateError
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from model.tokenizer import BOS, EOS, PAD, TOKENIZER_CONFIG_FILE, special_ids

ROLES = ("system", "user", "assistant")
# Who speaks each role's lines when a message has no name: the chorus sets the scene.
DEFAULT_SPEAKERS = {"system": "CHORUS", "user": "ROMEO", "assistant": "JULIET"}
# What the server passes (speakers, assistant_name) has defaults inside, so that Hugging Face's
# apply_chat_template, which passes only messages and the special tokens, renders the same
# scene; it also renders bos_token, which the server leaves empty (it puts <|bos|> first itself).
_HF_SPEAKERS = json.dumps({**DEFAULT_SPEAKERS, "developer": DEFAULT_SPEAKERS["system"]})
DEFAULT_TEMPLATE = (
    (
        "{%- if speakers is not defined -%}\n"
        f"{{%- set speakers = {_HF_SPEAKERS} -%}}\n"
        "{%- endif -%}\n"
    )
    + """\
{%- if assistant_name is not defined -%}
{%- set reply = namespace(name=speakers["assistant"]) -%}
{%- for message in messages if message.role == "assistant" -%}
{%- set reply.name = message.name or speakers["assistant"] -%}
{%- endfor -%}
{%- set assistant_name = reply.name -%}
{%- endif -%}
{{- bos_token -}}
{%- for message in messages -%}
{{ (message.name or speakers[message.role]) | upper }}:
{{ message.content }}{{ eos_token }}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ assistant_name | upper }}:
{% endif -%}
"""
)


def default_tokenizer_config() -> dict[str, str]:
    """The ``tokenizer_config.json`` a checkpoint gets when it brings none: Hugging Face's keys
    for the special tokens (its ``apply_chat_template`` passes them to the template) and the
    default template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "chat_template": DEFAULT_TEMPLATE,
    }


RENDER_SECONDS = 0.5  # the longest a rendering may take
MAX_RENDERED_CHARS = 1_000_000  # the default bound on a rendering's output
MAX_BITS = 4096  # the largest integer a template's ``**`` may make


class ChatTemplateError(ValueError):
    """The template refused the conversation, or could not be rendered."""


_MAX_CHARS: ContextVar[int] = ContextVar("max_chars", default=MAX_RENDERED_CHARS)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with the operators that make huge values in one step bounded:
    ``*`` of a sequence (its result at most the rendering's ``max_chars`` long) and ``**``."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            limit = _MAX_CHARS.get()
            for sequence, count in ((left, right), (right, left)):
                sized = isinstance(sequence, str | list | tuple) and isinstance(count, int)
                if sized and len(sequence) * count > limit:
                    raise ChatTemplateError(
                        f"the chat template makes a sequence of {len(sequence) * count:,} items "
                        f"(at most {limit:,})"
                    )
        integers = operator == "**" and isinstance(left, int) and isinstance(right, int)
        if integers and right > 0 and abs(left) > 1 and right * math.log2(abs(left)) > MAX_BITS:
            raise ChatTemplateError(
                f"the chat template computes {left} ** {right}, an integer past {MAX_BITS} bits"
            )
        return super().call_binop(context, operator, left, right)


@contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Raise ChatTemplateError in the Python code this thread runs once ``seconds`` have passed
    (checked at every line; the thread's previous trace function is restored after)."""
    deadline = time.monotonic() + seconds

    def check(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise ChatTemplateError(f"{what} took longer than {seconds} s")
        return check

    previous = sys.gettrace()
    sys.settrace(check)
    try:
        yield
    finally:
        sys.settrace(previous)


@dataclass(frozen=True)
class Message:
    role: str  # one of ROLES
    content: str
    name: str | None = None  # the speaker; None: the role's default


@dataclass(frozen=True)
class Scene:
    """A rendered conversation: the prompt's token ids (with <|bos|>) and the stop strings that
    end the reply where another speaker of the scene would begin."""

    prompt_ids: list[int]
    stops: list[str]
    speaker: str  # who speaks the reply


def _raise(message: str) -> NoReturn:
    raise ChatTemplateError(message)


class ChatTemplate:
    """A compiled chat template."""

    def __init__(self, source: str = DEFAULT_TEMPLATE) -> None:
        environment = BoundedSandbox(keep_trailing_newline=True)
        environment.globals["raise_exception"] = _raise
        try:
            self.template = environment.from_string(source)
        except TemplateError as error:
            raise ChatTemplateError(f"the chat template does not compile: {error}") from None
        self.source = source

    @classmethod
    def from_checkpoint(cls, folder: str | Path) -> ChatTemplate:
        """The template of the checkpoint ``folder``, or the default if it brings none."""
        config_path = Path(folder) / TOKENIZER_CONFIG_FILE
        if not config_path.is_file():
            return cls()
        try:
            source = json.loads(config_path.read_text()).get("chat_template")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
            raise ChatTemplateError(f"{config_path} is not a JSON object: {error}") from None
        if source is None:
            return cls()
        if not isinstance(source, str):
            raise ChatTemplateError(f"{config_path}: chat_template must be a string")
        return cls(source)

    def render(
        self, messages: Sequence[Message], eos_token: str, max_chars: int = MAX_RENDERED_CHARS
    ) -> str:
        """The conversation as text, ending with the reply's speaker line; a ChatTemplateError
        past ``max_chars`` of output or :data:`RENDER_SECONDS` (module docstring)."""
        speaker = reply_speaker(messages)
        context: dict[str, Any] = {
            "messages": [message.__dict__ for message in messages],
            "add_generation_prompt": True,
            "eos_token": eos_token,
            "bos_token": "",  # encode puts <|bos|> first
            "speakers": DEFAULT_SPEAKERS,
            "assistant_name": speaker,
        }
        pieces: list[str] = []
        bound = _MAX_CHARS.set(max_chars)
        length = 0
        try:
            with time_limit(RENDER_SECONDS, "rendering the chat template"):
                for piece in self.template.generate(context):
                    pieces.append(piece)
                    length += len(piece)
                    if length > max_chars:
                        raise ChatTemplateError(
                            f"the chat template's output passed {max_chars:,} characters"
                        )
        except ChatTemplateError:
            raise
        except RecursionError:
            raise ChatTemplateError("the chat template recursed too deeply") from None
        except (TemplateError, KeyError, TypeError, ValueError, OverflowError) as error:
            raise ChatTemplateError(f"the chat template failed: {error}") from None
        except MemoryError:
            raise ChatTemplateError("the chat template ran out of memory") from None
        finally:
            _MAX_CHARS.reset(bound)
        return "".join(pieces)

    def encode(
        self, tokenizer: Tokenizer, messages: Sequence[Message], max_chars: int = MAX_RENDERED_CHARS
    ) -> Scene:
        """Render ``messages`` (at most ``max_chars`` besides an ``eos_token`` a message) and
        turn the text into token ids, ``eos_token`` into <|eos|>.

        The text a user wrote is encoded as text: a literal ``"<|eos|>"`` in it stays bytes (the
        template's ``eos_token`` is a random marker, split out before tokenizing).
        """
        marker = f"\ue000{uuid.uuid4().hex}\ue000"
        special = special_ids(tokenizer)
        ids = [special.bos]
        markers = len(marker) * (len(messages) + 1)  # one eos_token a message, as the default
        text = self.render(messages, marker, max_chars + markers)
        for index, piece in enumerate(text.split(marker)):
            if index:
                ids.append(special.eos)
            ids.extend(tokenizer.encode(piece).ids if piece else [])
        speakers = {speaker_of(message).upper() for message in messages}
        speakers.add(reply_speaker(messages).upper())
        return Scene(ids, sorted(f"\n{name}:" for name in speakers), reply_speaker(messages))


def speaker_of(message: Message) -> str:
    return message.name or DEFAULT_SPEAKERS[message.role]


def reply_speaker(messages: Sequence[Message]) -> str:
    """The reply's speaker: the last assistant message's, else the assistant's default."""
    names = [speaker_of(message) for message in messages if message.role == "assistant"]
    return (names[-1] if names else DEFAULT_SPEAKERS["assistant"]).upper()
