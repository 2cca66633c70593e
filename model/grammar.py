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

# The most places a grammar's mask memo keeps (each a mask of vocab/8 bytes: 2,048 places are
# 1 MB at a 4,096-token vocabulary), and the most grammars memoised at once.
MEMO_PLACES = 2048
MEMO_GRAMMARS = 16


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


class Place:
    """A place in a grammar, reached by the tokens from its start to here: what llguidance
    said of it (its mask, whether it is complete), and the places one more token leads to."""

    __slots__ = ("allowed", "complete", "kept", "next")

    def __init__(self, allowed: bytes, complete: bool) -> None:
        self.allowed, self.complete = allowed, complete
        self.kept = False  # the memo holds it (only a kept place has places after it)
        self.next: dict[int, Place] = {}


class MaskMemo:
    """The places of one grammar (on one tokenizer) that its sequences have been through: a
    trie on the tokens drawn, at most ``capacity`` places (the first ones reached stay).

    A matcher's state, so its mask, is a function of the tokens it has consumed: a sequence
    that follows a path another sequence of the same grammar took needs no llguidance call
    at all. Requests that share a constraint (a ``choice`` of labels, an enum, a schema's
    fixed keys) mostly do."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.places = 0
        self.root: Place | None = None

    def add(self, parent: Place | None, token: int, place: Place) -> None:
        """Keep ``place`` as where ``token`` leads from ``parent`` (a kept place; None: the
        root), if there is room."""
        if self.places >= self.capacity:
            return
        self.places += 1
        place.kept = True
        if parent is None:
            self.root = place
        else:
            parent.next[token] = place


@functools.lru_cache(maxsize=MEMO_GRAMMARS)
def mask_memo(tokenizer: llguidance.LLTokenizer, grammar: str) -> MaskMemo:
    """The memo every matcher of ``grammar`` on ``tokenizer`` shares (engine thread only);
    ``MEMO_PLACES`` as it is when the grammar is first seen."""
    return MaskMemo(MEMO_PLACES)


class GrammarMatcher:
    """One sequence's place in its grammar. Compiling starts at once, on a worker thread; the
    first call that needs the matcher waits for it (by then, usually, it is long done). Masks
    are computed on the caller's thread: handing each step's mask to a worker cost more than
    computing it (the worker waits for the GIL behind the decode step).

    Along a path its grammar's :class:`MaskMemo` holds, the matcher only walks the memo; the
    tokens walked are fed to llguidance (in one call) only when the path leaves the memo."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self._future: Future[llguidance.LLMatcher] = _COMPILER.submit(_compile, tokenizer, grammar)
        self._compiled: llguidance.LLMatcher | None = None  # the future's result, once taken
        self._memo = mask_memo(tokenizer, grammar)
        self._unfed: list[int] = []  # tokens walked in the memo, not yet fed to llguidance
        self._start()

    def _start(self) -> None:
        self._place = self._memo.root  # None: not known yet (llguidance is asked when needed)
        # while the place is not known: where the memo would keep it (a kept place, or None
        # for the root, and the token from there); None once the sequence has left the memo
        self._parent: tuple[Place | None, int] | None = (None, -1)
        self._unfed.clear()

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
        return self._here().allowed

    def advance(self, token: int) -> None:
        """Record the token drawn; GrammarError if the grammar did not allow it."""
        place = self._here()
        allowed = place.allowed
        if not 0 <= token < 8 * len(allowed) or not allowed[token >> 3] >> (token & 7) & 1:
            matcher = self._fed()
            matcher.consume_token(token)  # refused: llguidance says why
            why = matcher.get_error().splitlines()[0]
            raise GrammarError(f"token {token} is not allowed here: {why}")
        self._unfed.append(token)
        self._place = place.next.get(token)
        self._parent = (place, token) if self._place is None and place.kept else None

    @property
    def complete(self) -> bool:
        """Nothing can follow: the output is whole, and the sequence should end now."""
        return self._here().complete

    def restart(self) -> None:
        """Back to the grammar's start, as a new sequence."""
        self._matcher.reset()
        self._start()

    def _here(self) -> Place:
        """The place the sequence is at: from the memo, or asked of llguidance (and kept in
        the memo if the sequence is still on it and there is room)."""
        place = self._place
        if place is None:
            matcher = self._fed()
            place = self._place = Place(matcher.compute_bitmask(), matcher.is_stopped())
            if self._parent is not None:
                self._memo.add(*self._parent, place)
            self._parent = None
        return place

    def _fed(self) -> llguidance.LLMatcher:
        """The matcher, having consumed every token drawn so far."""
        matcher = self._matcher
        if self._unfed:
            tokens, self._unfed = self._unfed, []
            if not matcher.consume_tokens(tokens):  # each allowed by its mask: cannot happen
                raise GrammarError(matcher.get_error())
        return matcher


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
