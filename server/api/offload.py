"""Work on a request that must not run on the event loop: tokenising, chat templates, grammars.

Tokenising a 1 MB prompt takes about half a second, and a checkpoint's chat template is code of
its own: on the event loop either would hold every stream and ``/health`` meanwhile. They run
in :data:`POOL` (:func:`token_ids` encodes through ``encode_batch``, which releases the GIL while
it works, where ``encode`` holds it throughout; a template is bounded in time and output by
``model.chat``), and a request waits at most :data:`TIMEOUT` seconds for its result. A short text
is tokenised in :data:`SHORT_POOL` (:func:`tokenised`), so it never waits behind a long one,
and a chat's scene is made in :data:`CHAT_POOL`, so a long template waits only for chats; a
structured output's grammar is checked in :data:`GRAMMAR_POOL` (``server.api.structured``).
What makes the bound hold is the size of the text: a prompt whose UTF-8 is longer than the
model's context could hold (:func:`check_prompt_size`) is refused before it is tokenised.
"""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from tokenizers import Tokenizer

from server.api.errors import APIError, busy

POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ordinal-text")  # a core is left
# Short texts are tokenised in a lane of their own: behind four 1 MB texts in POOL, the eight
# streams of tests/server/test_fair_share.py waited 2.6 s for their first token.
SHORT_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ordinal-short-text")
SHORT_TEXT = 8192  # characters: ~2 ms of tokenising, the most a short text waits behind one
# Chat scenes (a template, then tokens) too: a template may take its whole time bound.
CHAT_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ordinal-chat")
# Grammars too: a check may take model.grammar's compile budget (0.5 s of CPU), so grammar
# bombs delay only other requests' grammars.
GRAMMAR_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ordinal-grammar-check")
TIMEOUT = 10.0  # seconds a request waits for its text to be tokenised or rendered, or its grammar

P = ParamSpec("P")
T = TypeVar("T")


async def tokenised(
    tokenizer: Tokenizer, text: str, bos: int | None, specials: Mapping[str, int] | None = None
) -> list[int]:
    """:func:`token_ids` off the event loop: in :data:`SHORT_POOL` for a text of at most
    :data:`SHORT_TEXT` characters, else in :data:`POOL`; a 503 if it takes over TIMEOUT s.
    ``specials`` (name → id): the special tokens whose names in the text are read as them."""
    pool = SHORT_POOL if len(text) <= SHORT_TEXT else POOL
    return await in_lane(pool, token_ids, tokenizer, text, bos, specials)


async def in_lane(
    pool: ThreadPoolExecutor, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs
) -> T:
    """``function(*args, **kwargs)`` run in ``pool``; a 503 if it takes over TIMEOUT s."""
    future = asyncio.get_running_loop().run_in_executor(pool, lambda: function(*args, **kwargs))
    try:
        return await asyncio.wait_for(future, TIMEOUT)
    except TimeoutError:
        waited = f"preparing the request took longer than {TIMEOUT:.0f} s"
        raise busy(waited, status=503) from None


def token_ids(
    tokenizer: Tokenizer, text: str, bos: int | None, specials: Mapping[str, int] | None = None
) -> list[int]:
    """``text``'s token ids after the id ``bos`` (None: none), as ``encode_prompt`` gives a text
    (the served model's bos is computed once, at load), by ``encode_batch``: measured on a 1 MB
    prompt, ``encode`` held the GIL for all of its 1.6 s, ``encode_batch`` for under 0.3 s.

    With ``specials``, each of their names in the text is that token and the text between them
    is encoded piece by piece, as Hugging Face's tokenizers read their special tokens (a
    prompt's text never is: ordinal's tokenizers encode those names as ordinary bytes)."""
    names = specials or {}
    pieces = re.split(_names_pattern(tuple(names)), text) if names else [text]
    encoded = tokenizer.encode_batch(pieces[0::2])  # the names are at the odd places
    ids = [] if bos is None else [bos]
    for index, encoding in enumerate(encoded):
        if index:
            ids.append(names[pieces[2 * index - 1]])
        ids.extend(encoding.ids)
    return ids


@functools.lru_cache(maxsize=64)
def _names_pattern(names: tuple[str, ...]) -> re.Pattern[str]:
    """A pattern that splits a text at each of ``names``, keeping them (longest first)."""
    return re.compile("(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + ")")


def most_prompt_bytes(max_context: int, token_bytes: list[bytes], specials: list[str]) -> int:
    """The longest UTF-8 text that can become ``max_context`` tokens: each token of a byte-level
    tokenizer stands for at most its own bytes (a special token for its name)."""
    longest = max(max(map(len, token_bytes)), *(len(name.encode()) for name in specials))
    return max_context * longest


def check_prompt_size(text: str, limit: int, model: str, field: str = "prompt") -> None:
    """A 400 (context_length_exceeded) for a text longer than ``limit`` bytes of UTF-8, naming
    ``field`` (``input[2]``: its top-level field is the error's ``param``)."""
    if len(text) <= limit // 4:  # at most 4 bytes a character: short enough without counting
        return
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise APIError(
            400,
            f"{field}: the text is {size:,} bytes long but model '{model}''s context holds at most "
            f"{limit:,} bytes of text (its max_context times its longest token)",
            param=field.split("[")[0],
            code="context_length_exceeded",
        )
