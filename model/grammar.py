"""Structured outputs: a grammar every generated token must keep to, through llguidance.

The API process turns a request's constraint (a JSON schema, a regular expression, a list of
choices, a Lark or GBNF grammar) into llguidance's grammar text with :func:`grammar_of` and checks
it with :func:`grammar_error` (a 400 naming the field otherwise); the text travels to the engine
in ``SamplingParams.grammar``. The engine gives each constrained row a :class:`GrammarMatcher`,
which ``model.sampling`` asks for the row's allowed tokens before each draw and tells the token
drawn. The tokenizer llguidance sees is the checkpoint's own (:func:`grammar_tokenizer`).

No torch here: the API process imports this module.
"""

from __future__ import annotations

import functools
import json
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

import llguidance
from tokenizers import Tokenizer

from model.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

Kind = Literal["json", "regex", "choice", "grammar"]

# A longer constraint (a schema's JSON, a regex, a grammar, the choices) is refused: measured on
# this machine, compiling a 62 kB schema of 1000 properties took 0.16 s, and the cost grows with
# the size; 32 kB keeps every compile well under a decode step's worth of stalls (it runs off
# the event loop and the engine loop, but a core is still busy meanwhile).
MAX_CONSTRAINT_CHARS = 32_768

# JSON without optional whitespace: a model then spends no tokens on indentation.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}

# Matchers are compiled here, off the engine loop (llguidance drops the GIL while it compiles).
_COMPILER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ordinal-grammar")


class GrammarError(ValueError):
    """A grammar llguidance cannot compile, or a matcher that has failed."""


def grammar_of(kind: Kind, spec: Any) -> str:
    """llguidance's grammar text for a constraint of ``kind``: ``json`` a JSON schema (an object
    or its text), ``regex`` a pattern the whole output matches, ``choice`` a list of strings
    the output is one of, ``grammar`` a Lark (or llama.cpp GBNF) grammar. Raises GrammarError
    for a spec that is not even of the right form (it does not compile the grammar)."""
    text = spec if isinstance(spec, str) else json.dumps(spec)
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise GrammarError(
            f"is {len(text):,} characters long; at most {MAX_CONSTRAINT_CHARS:,} are accepted"
        )
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            if not spec:
                raise GrammarError("must hold at least one string")
            return llguidance.grammar_from("choice", spec)
        return llguidance.grammar_from("grammar", spec)
    except Exception as error:  # whatever llguidance cannot read is the request's fault
        raise GrammarError(str(error)) from None


@functools.lru_cache(maxsize=64)  # a model's tokenizer lives as long as the model
def grammar_tokenizer(tokenizer: Tokenizer, eos: int) -> llguidance.LLTokenizer:
    """llguidance's view of ``tokenizer`` (a checkpoint's byte-level BPE), ``eos`` the token
    that ends a sequence: about 30 ms for a 2048-token vocabulary, so made once per model."""
    return llguidance.LLTokenizer(tokenizer.to_str(), eos_token=eos)


def grammar_error(grammar: str, tokenizer: llguidance.LLTokenizer) -> str | None:
    """Why llguidance cannot compile ``grammar`` for ``tokenizer`` (None: it can). Slow for a
    large grammar (it compiles it): call it off the event loop."""
    return llguidance.LLMatcher.validate_grammar(grammar, tokenizer) or None


class GrammarMatcher:
    """One sequence's place in its grammar. Compiling starts at once, on a worker thread; the
    first call that needs the matcher waits for it (by then, usually, it is long done). Masks
    are computed on the caller's thread: handing each step's mask to a worker cost more than
    computing it (the worker waits for the GIL behind the decode step)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self._future: Future[llguidance.LLMatcher] = _COMPILER.submit(_compile, tokenizer, grammar)
        self._compiled: llguidance.LLMatcher | None = None  # the future's result, once taken

    @property
    def _matcher(self) -> llguidance.LLMatcher:
        """The compiled matcher; GrammarError if it has failed. Read three times a step, so the
        future is waited on once, not on every read."""
        matcher = self._compiled
        if matcher is None:
            matcher = self._compiled = self._future.result()
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def allowed(self) -> bytes:
        """The tokens allowed next: bit t (little-endian within each byte) set for token t.
        Once the grammar is complete only the end-of-sequence token is allowed."""
        return self._matcher.compute_bitmask()

    def advance(self, token: int) -> None:
        """Record the token drawn; GrammarError if the grammar did not allow it."""
        matcher = self._matcher
        if not matcher.consume_token(token):
            why = matcher.get_error().splitlines()[0]
            raise GrammarError(f"token {token} is not allowed here: {why}")

    @property
    def complete(self) -> bool:
        """Nothing can follow: the output is whole, and the sequence should end now."""
        return self._matcher.is_stopped()

    def restart(self) -> None:
        """Back to the grammar's start, as a new sequence."""
        self._matcher.reset()


def _compile(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()  # the first mask builds the lexer: here, not in a decode step
    return matcher


def constraint_of(params: SamplingParams, tokenizer: Tokenizer, eos: int) -> GrammarMatcher | None:
    """The matcher of a row sampled with ``params`` (None when it has no grammar)."""
    if params.grammar is None:
        return None
    return GrammarMatcher(grammar_tokenizer(tokenizer, eos), params.grammar)
