"""Structured outputs: a grammar every generated token must keep to, through llguidance.

The API process turns a request's constraint (a JSON schema, a regular expression, a list of
choices, a Lark or GBNF grammar) into llguidance's grammar text with :func:`grammar_of` and checks
it with :func:`grammar_error` (a 400 naming the field otherwise); the text travels to the engine
in ``SamplingParams.grammar``. The engine gives each constrained row a :class:`GrammarMatcher`,
which ``model.sampling`` asks for the row's allowed tokens before each draw and tells the token
drawn. The tokenizer llguidance sees is the checkpoint's own (:func:`grammar_tokenizer`).

Every grammar's work is bounded, as SGLang and vLLM bound theirs (compiled off the decode loop,
the request held back until it is, refused or aborted past a limit): llguidance's own limits
(:data:`LIMITS`); compiling it and its first mask within :data:`COMPILE_BUDGET` of CPU, on a
worker; each later mask within :data:`MASK_BUDGET`. :func:`grammar_error` checks all three
before a request is accepted, along the first :data:`PROBE_STEPS` tokens of one path; a matcher
that fails or passes a budget later fails its own row (``GrammarError``).

No torch here: the API process imports this module.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

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

# llguidance's limits, its defaults but for the fuel its lexer may spend building regular
# expressions (default 1,000,000): ((a{100}){100}){100} spent 0.8 s of CPU on it before failing
# with "too many expressions constructed", 0.1 s with a fifth. The tests' grammars and a 30 kB
# schema of 560 properties need far less. Its errors without the parser's state and grammar.
LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=200_000, verbose_errors=False)
# CPU seconds (of the thread doing it, so a busy host does not count) that compiling a grammar
# and computing its first mask may take; the 30 kB schema took 0.06 s, the bomb above 0.8 s.
COMPILE_BUDGET = 0.5
# CPU seconds one mask may take (the tokens fed since the last one included). Measured on the
# shipped 2,048-token vocabulary: every test grammar ≤ 0.3 ms, ((a{80}){80}){4} 7–9 ms,
# ((a{80}){80}){24} 46 ms. It runs on the engine loop, so every other stream waits for it: six
# rows within it cost the others at most 60 ms a step.
MASK_BUDGET = 0.010
# Tokens of one path (the lowest allowed each time) a grammar is walked before it is accepted.
PROBE_STEPS = 4

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
    """Why ``grammar`` cannot be served on ``tokenizer`` (None: it can): llguidance cannot
    compile it, compiling it takes over COMPILE_BUDGET, its first mask allows no token, or
    along the first PROBE_STEPS tokens of one path (the lowest token allowed each time, not the
    end of the sequence) a mask fails or takes over MASK_BUDGET. It compiles the grammar: up to
    ~COMPILE_BUDGET + PROBE_STEPS × MASK_BUDGET of CPU; call it off the event loop."""
    try:
        matcher, place = _compile(tokenizer, grammar)
    except GrammarError as error:
        return str(error)
    for step in range(PROBE_STEPS):
        token = next((t for t in _allowed_ids(place.allowed) if t != tokenizer.eos_token), None)
        if place.complete or token is None:
            break
        try:
            place = _step(matcher, [token])
        except GrammarError as error:
            return f"after {step + 1} token(s) of output: {error}"
    return None


def _allowed_ids(mask: bytes) -> Iterator[int]:
    """The tokens a mask allows, lowest first."""
    for index, byte in enumerate(mask):
        for bit in range(8):
            if byte >> bit & 1:
                yield 8 * index + bit


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


class Compiled(NamedTuple):
    """A grammar compiled for one sequence: its matcher, and the place at its start."""

    matcher: llguidance.LLMatcher
    start: Place


class GrammarMatcher:
    """One sequence's place in its grammar. Compiling starts at once, on a worker thread:
    :attr:`ready` says when it is done, and the engine lets the row join a batch only then (a
    call that needs the matcher earlier waits for it). Masks are computed on the caller's
    thread: handing each step's mask to a worker cost more than computing it (the worker waits
    for the GIL behind the decode step). Each is held to MASK_BUDGET.

    Along a path its grammar's :class:`MaskMemo` holds, the matcher only walks the memo; the
    tokens walked are fed to llguidance (in one call) only when the path leaves the memo.

    Once it has failed (a compile error, a budget passed, a token refused) every method raises
    GrammarError with :attr:`failure`."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self._future: Future[Compiled] = _COMPILER.submit(_compile, tokenizer, grammar)
        self._compiled: Compiled | None = None  # the future's result, once taken
        self.failure: str | None = None  # why it failed (None: it has not)
        self._memo = mask_memo(tokenizer, grammar)
        self._unfed: list[int] = []  # tokens walked in the memo, not yet fed to llguidance
        self._start()

    def _start(self) -> None:
        self._place = self._memo.root  # None: not known yet (llguidance is asked when needed)
        # while the place is not known: where the memo would keep it (a kept place, or None
        # for the root, and the token from there); None once the sequence has left the memo
        self._parent: tuple[Place | None, int] | None = _AT_START
        self._unfed.clear()

    @property
    def ready(self) -> bool:
        """Compiled, or failed to: the matcher answers without waiting for the worker."""
        return self._future.done()

    def check(self) -> None:
        """GrammarError if compiling failed (waits for the worker unless :attr:`ready`)."""
        self._take()

    def _take(self) -> Compiled:
        """The compiled matcher; GrammarError if it has failed. Read three times a step, so the
        future is waited on once, not on every read."""
        if self.failure is not None:
            raise GrammarError(self.failure)
        compiled = self._compiled
        if compiled is None:
            try:
                compiled = self._compiled = self._future.result()
            except GrammarError as error:
                raise self._failed(str(error)) from None
        return compiled

    def allowed(self) -> bytes:
        """The tokens allowed next: bit t (little-endian within each byte) set for token t.
        Once the grammar is complete only the end-of-sequence token is allowed."""
        return self._here().allowed

    def advance(self, token: int) -> None:
        """Record the token drawn, and find the mask after it (so a failure there is this
        draw's, and :attr:`complete` never fails); GrammarError if the grammar did not allow
        the token or the next mask fails."""
        place = self._here()
        allowed = place.allowed
        if not 0 <= token < 8 * len(allowed) or not allowed[token >> 3] >> (token & 7) & 1:
            matcher = self._fed()
            matcher.consume_token(token)  # refused: llguidance says why
            why = _why(matcher)
            raise self._failed(f"token {token} is not allowed here: {why}")
        self._unfed.append(token)
        self._place = place.next.get(token)
        self._parent = (place, token) if self._place is None and place.kept else None
        self._here()

    @property
    def complete(self) -> bool:
        """Nothing can follow: the output is whole, and the sequence should end now."""
        return self._here().complete

    def restart(self) -> None:
        """Back to the grammar's start, as a new sequence."""
        self._take().matcher.reset()
        self._start()

    def _here(self) -> Place:
        """The place the sequence is at: from the memo, or asked of llguidance (and kept in
        the memo if the sequence is still on it and there is room)."""
        place = self._place
        if place is None:
            compiled = self._take()
            if self._parent is _AT_START:  # compiling computed it
                place = compiled.start
            else:
                tokens, self._unfed = self._unfed, []
                try:
                    place = _step(compiled.matcher, tokens)
                except GrammarError as error:
                    raise self._failed(str(error)) from None
            self._place = place
            if self._parent is not None:
                self._memo.add(*self._parent, place)
            self._parent = None
        return place

    def _fed(self) -> llguidance.LLMatcher:
        """The matcher, having consumed every token drawn so far."""
        matcher = self._take().matcher
        if self._unfed:
            tokens, self._unfed = self._unfed, []
            if not matcher.consume_tokens(tokens):  # each allowed by its mask: cannot happen
                raise self._failed(_why(matcher))
        return matcher

    def _failed(self, why: str) -> GrammarError:
        """The error to raise now and at every later call."""
        self.failure = why
        return GrammarError(why)


_AT_START: tuple[Place | None, int] = (None, -1)  # a matcher's parent before its first token


def _why(matcher: llguidance.LLMatcher) -> str:
    """llguidance's error, without the line that stands for its parser state (LIMITS asks for
    errors without it)."""
    lines = matcher.get_error().splitlines()
    return "\n".join(line for line in lines if line != "<non-verbose/>").strip()


def _compile(tokenizer: llguidance.LLTokenizer, grammar: str) -> Compiled:
    """``grammar`` compiled and its first mask computed (that builds the lexer): here, on a
    worker, not in a decode step. GrammarError if llguidance cannot, if it takes over
    COMPILE_BUDGET of CPU, or if the first mask allows no token at all."""
    started = time.thread_time()
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
    if matcher.is_error():
        raise GrammarError(f"llguidance cannot compile it: {_why(matcher)}")
    allowed = matcher.compute_bitmask()
    spent = time.thread_time() - started
    if matcher.is_error():
        why = _why(matcher)
        if why == "NoExtensionBias":  # llguidance's word for a start nothing can follow
            why = "no output can match it (a JSON schema whose $refs only lead to each other)"
        raise GrammarError(f"llguidance cannot start it: {why}")
    if spent > COMPILE_BUDGET:
        raise GrammarError(
            f"compiling it took {spent:.2f} s of CPU; at most {COMPILE_BUDGET} s are allowed"
        )
    if not any(allowed):
        raise GrammarError("no token is allowed at its start")
    return Compiled(matcher, Place(allowed, matcher.is_stopped()))


def _step(matcher: llguidance.LLMatcher, tokens: list[int]) -> Place:
    """Where ``tokens`` (each allowed in turn) lead ``matcher``: it consumes them and computes
    the mask there. GrammarError if llguidance fails, or if it takes over MASK_BUDGET of CPU
    a token (the mask is one step's work; tokens walked in the memo are fed here at once)."""
    started = time.thread_time()
    if tokens and not matcher.consume_tokens(tokens):  # each allowed by its mask
        raise GrammarError(_why(matcher))
    allowed = matcher.compute_bitmask()
    spent = time.thread_time() - started
    if matcher.is_error():
        raise GrammarError(_why(matcher))
    if spent > MASK_BUDGET * max(1, len(tokens)):
        raise GrammarError(
            f"its token mask took {spent * 1e3:.1f} ms of CPU to compute; at most "
            f"{MASK_BUDGET * 1e3:g} ms a token are allowed"
        )
    return Place(allowed, matcher.is_stopped())


def constraint_of(params: SamplingParams, tokenizer: Tokenizer, eos: int) -> GrammarMatcher | None:
    """The matcher of a row sampled with ``params`` (None when it has no grammar)."""
    if params.grammar is None:
        return None
    return GrammarMatcher(grammar_tokenizer(tokenizer, eos), params.grammar)
