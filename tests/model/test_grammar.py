"""Structured outputs in the one sampling place: a constrained row draws only tokens its grammar
allows (−inf before every filter), ends where its grammar does, draws exactly what it draws
alone when it shares a batch, and costs the unconstrained rows of its batch nothing (their
tokens are unchanged) — on rope and two other schemes, since the mask never sees positions."""

from __future__ import annotations

import json
import random
import re
import time

import llguidance
import pytest
import torch
from tokenizers import Tokenizer

import model.grammar
from model.generate import generate
from model.grammar import (
    MAX_CONSTRAINT_CHARS,
    GrammarError,
    GrammarMatcher,
    grammar_error,
    grammar_of,
    grammar_tokenizer,
    mask_memo,
)
from model.sampling import RowSampler, SamplingBatch
from model.sampling_params import FailureReason, SamplingParams
from tests.model.conftest import TINY_VOCAB, random_model

PATTERN = r"(yes|no|maybe)-[a-z]{2,6}"
SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 6},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["word", "count"],
    "additionalProperties": False,
}


class Allow:
    """A constraint allowing a fixed set of tokens; records what it was given."""

    def __init__(self, tokens: list[int], fail: bool = False) -> None:
        self.tokens, self.fail, self.taken = tokens, fail, []

    def allowed(self) -> bytes:
        if self.fail:
            raise RuntimeError("broken grammar")
        bits = bytearray(TINY_VOCAB // 8 + 1)
        for token in self.tokens:
            bits[token // 8] |= 1 << (token % 8)
        return bytes(bits)

    def advance(self, token: int) -> None:
        self.taken.append(token)

    @property
    def complete(self) -> bool:
        return False


def test_the_mask_applies_before_temperature_top_k_and_top_p() -> None:
    logits = torch.randn(3, TINY_VOCAB, generator=torch.Generator().manual_seed(0))
    allowed = [7, 40, 41, 300]
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_k=2)
    constraints = [Allow(allowed), Allow(allowed)]
    batch = SamplingBatch(
        [
            RowSampler(greedy, constraints[0]),
            RowSampler(SamplingParams(temperature=0)),  # unconstrained: the raw argmax
            RowSampler(sampled, constraints[1]),
        ]
    )
    tokens = batch.sample(logits).tolist()
    assert tokens[0] == max(allowed, key=lambda t: logits[0, t].item())
    assert tokens[1] == logits[1].argmax().item()
    # top_k 2 keeps the two best *allowed* tokens: the mask came first
    best_two = sorted(allowed, key=lambda t: logits[2, t].item())[-2:]
    assert tokens[2] in best_two
    assert [c.taken for c in constraints] == [[tokens[0]], [tokens[2]]]


def test_a_failing_grammar_fails_its_row_alone() -> None:
    logits = torch.randn(2, TINY_VOCAB, generator=torch.Generator().manual_seed(1))
    rows = [RowSampler(SamplingParams(temperature=0), Allow([], fail=True))]
    rows.append(RowSampler(SamplingParams(temperature=0.7, seed=3)))
    alone = SamplingBatch([RowSampler(SamplingParams(temperature=0.7, seed=3))])
    tokens, failures = SamplingBatch(rows).draw(logits)
    assert failures == {0: FailureReason.GRAMMAR_FAILED}
    assert rows[0].failure == "broken grammar" and rows[1].failure is None
    assert tokens[1] == alone.sample(logits[1:])[0]


def test_a_row_with_a_grammar_needs_its_matcher() -> None:
    with pytest.raises(ValueError, match="constraint"):
        RowSampler(SamplingParams(grammar=grammar_of("regex", "a")))


def test_what_llguidance_rejects_is_named_and_a_huge_constraint_is_refused(
    tiny_tokenizer: Tokenizer,
) -> None:
    tokens = grammar_tokenizer(tiny_tokenizer, tiny_tokenizer.token_to_id("<|eos|>"))
    assert "unclosed group" in (grammar_error(grammar_of("regex", "a(b"), tokens) or "")
    assert grammar_error(grammar_of("json", SCHEMA), tokens) is None
    assert grammar_error(grammar_of("regex", PATTERN), tokens) is None
    assert "strin" in (grammar_error(grammar_of("json", {"type": "strin"}), tokens) or "")
    assert "foo" in (grammar_error(grammar_of("grammar", "start: foo"), tokens) or "")
    assert grammar_error(grammar_of("grammar", 'root ::= "a" [b-c]+'), tokens) is None  # GBNF
    assert grammar_error(grammar_of("choice", ["x", "y"]), tokens) is None
    with pytest.raises(GrammarError, match="at most"):
        grammar_of("regex", "a" * (MAX_CONSTRAINT_CHARS + 1))
    with pytest.raises(GrammarError, match="at least one"):
        grammar_of("choice", [])
    broken = GrammarMatcher(tokens, grammar_of("regex", "a(b"))
    with pytest.raises(GrammarError, match="unclosed group"):
        broken.allowed()


@pytest.mark.parametrize("scheme", ["rope", "alibi", "learned"])
def test_constrained_rows_match_and_share_a_batch_as_if_alone(
    scheme: str, tiny_tokenizer: Tokenizer
) -> None:
    model = random_model(scheme, seed=2)
    regex, schema = grammar_of("regex", PATTERN), grammar_of("json", SCHEMA)
    free = [SamplingParams(temperature=1.0, seed=s) for s in (11, 12)]
    constrained = [SamplingParams(temperature=1.0, seed=s, grammar=regex) for s in range(4)]
    constrained += [SamplingParams(temperature=1.0, seed=s, grammar=schema) for s in range(2)]
    prompts = ["To be", "Fair is foul", "Now is", "All the", "If music", "We are", "So", "Or"]
    settings = [free[0], *constrained[:3], free[1], *constrained[3:]]
    together = generate(model, tiny_tokenizer, prompts, max_new_tokens=56, sampling=settings)
    for prompt, params, completion in zip(prompts, settings, together, strict=True):
        alone = generate(model, tiny_tokenizer, [prompt], max_new_tokens=56, sampling=params)[0]
        assert completion.token_ids == alone.token_ids  # constrained or not, as alone
        if params.grammar == regex:
            assert re.fullmatch(PATTERN, completion.text), completion.text
            assert completion.finish_reason == "stop"
        elif params.grammar == schema:
            assert completion.finish_reason == "stop", completion.text
            value = json.loads(completion.text)
            assert set(value) == {"word", "count"} and 0 <= value["count"] <= 99


def allowed_ids(mask: bytes) -> list[int]:
    return [t for t in range(8 * len(mask)) if mask[t >> 3] >> (t & 7) & 1]


def walk(
    matcher: GrammarMatcher, reference: llguidance.LLMatcher, rng: random.Random, steps: int
) -> list[int]:
    """Draw up to ``steps`` allowed tokens (at random, or the first allowed, so that walks
    meet); at each place the matcher's mask and completeness are llguidance's own."""
    drawn: list[int] = []
    for _ in range(steps):
        mask = matcher.allowed()
        assert mask == reference.compute_bitmask()
        assert matcher.complete == reference.is_stopped()
        if matcher.complete:
            break
        choices = allowed_ids(mask)
        token = choices[0] if rng.random() < 0.5 else rng.choice(choices)
        matcher.advance(token)
        assert reference.consume_token(token)
        drawn.append(token)
    return drawn


@pytest.mark.parametrize(
    "kind, spec",
    [("choice", ["ROMEO", "JULIET", "the Nurse"]), ("regex", PATTERN), ("json", SCHEMA)],
)
@pytest.mark.parametrize("capacity", [2048, 5])  # room for every place; for almost none
def test_matchers_sharing_a_memo_see_what_llguidance_sees(
    kind: str,
    spec: object,
    capacity: int,
    tiny_tokenizer: Tokenizer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Walks of one grammar, meeting and parting, restarted: every mask and every end is what
    a fresh llguidance matcher fed the same tokens says, with the memo roomy or full."""
    monkeypatch.setattr(model.grammar, "MEMO_PLACES", capacity)
    monkeypatch.setattr(model.grammar, "MASK_BUDGET", 1.0)  # a busy host must not fail a walk
    mask_memo.cache_clear()
    tokens = grammar_tokenizer(tiny_tokenizer, tiny_tokenizer.token_to_id("<|eos|>"))
    grammar = grammar_of(kind, spec)  # type: ignore[arg-type]
    rng = random.Random(kind)
    restarted = GrammarMatcher(tokens, grammar)
    for round_ in range(12):
        reference = llguidance.LLMatcher(tokens, grammar, log_level=0)
        if round_ % 3 == 2:
            restarted.restart()
            walk(restarted, reference, rng, 40)
        else:
            walk(GrammarMatcher(tokens, grammar), reference, rng, 40)
    assert 0 < mask_memo(tokens, grammar).places <= capacity
    mask_memo.cache_clear()


def test_a_path_walked_before_asks_llguidance_nothing(
    tiny_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    mask_memo.cache_clear()
    tokens = grammar_tokenizer(tiny_tokenizer, tiny_tokenizer.token_to_id("<|eos|>"))
    grammar = grammar_of("choice", ["ROMEO", "JULIET"])
    first = GrammarMatcher(tokens, grammar)
    path = walk(first, llguidance.LLMatcher(tokens, grammar, log_level=0), random.Random(1), 40)
    places = mask_memo(tokens, grammar).places
    asked: list[int] = []
    step = model.grammar._step
    monkeypatch.setattr(model.grammar, "_step", lambda *args: asked.append(1) or step(*args))
    again = GrammarMatcher(tokens, grammar)
    for token in path:
        assert token in allowed_ids(again.allowed())
        again.advance(token)
    assert again.complete and not asked  # the whole way on the memo
    assert mask_memo(tokens, grammar).places == places
    fresh = GrammarMatcher(tokens, grammar)
    refused = next(t for t in range(TINY_VOCAB) if t not in allowed_ids(fresh.allowed()))
    with pytest.raises(GrammarError, match="not allowed"):  # refused: llguidance says why
        fresh.advance(refused)
    mask_memo.cache_clear()


# ---- bounded work: what llguidance may spend on one grammar -----------------------------------

BOMB = "((a{100}){100}){100}"  # 20 bytes; a million-state regular expression
LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


def test_a_grammar_bomb_a_ref_loop_and_a_costly_mask_are_refused_before_they_run(
    tiny_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bomb compiles and gives a first mask, then fails at its first token: the check walks
    a few tokens, within llguidance's lowered lexer fuel (0.1 s, where the default spent 0.8 s).
    A $ref loop has a first mask and no way on. A mask over its budget is refused."""
    tokens = grammar_tokenizer(tiny_tokenizer, tiny_tokenizer.token_to_id("<|eos|>"))
    started = time.thread_time()
    why = grammar_error(grammar_of("regex", BOMB), tokens) or ""
    assert why.startswith("after 1 token(s) of output: ") and "too many expressions" in why
    assert time.thread_time() - started < model.grammar.COMPILE_BUDGET
    for loop in (LOOP, {"$ref": "#"}):
        assert "no output can match it" in (grammar_error(grammar_of("json", loop), tokens) or "")
    recursive = {"type": "object", "properties": {"next": {"$ref": "#"}}}  # a list: fine
    assert grammar_error(grammar_of("json", recursive), tokens) is None
    costly = grammar_of("regex", "((a{80}){80}){4}")  # a few ms of CPU a mask
    assert grammar_error(costly, tokens) is None
    monkeypatch.setattr(model.grammar, "MASK_BUDGET", 1e-4)
    why = grammar_error(costly, tokens) or ""
    assert re.fullmatch(
        r"after 1 token\(s\) of output: its token mask took \d+\.\d ms of CPU to compute; at "
        r"most 0\.1 ms a token are allowed",
        why,
    ), why
    monkeypatch.setattr(model.grammar, "COMPILE_BUDGET", 1e-4)
    assert "compiling it took" in (grammar_error(costly, tokens) or "")


def test_a_matcher_that_fails_after_its_start_fails_at_that_draw_and_stays_failed(
    tiny_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mask after a token is computed as the token is taken, inside the draw's per-row
    error handling: the bomb fails its row there (before, ``complete`` raised later, outside
    it, and the whole decode step failed). Every later call raises the same error."""
    mask_memo.cache_clear()
    tokens = grammar_tokenizer(tiny_tokenizer, tiny_tokenizer.token_to_id("<|eos|>"))
    bomb = GrammarMatcher(tokens, grammar_of("regex", BOMB))
    bomb._future.result()
    assert bomb.ready
    a = allowed_ids(bomb.allowed())[0]
    logits = torch.zeros(2, TINY_VOCAB)
    rows = [RowSampler(SamplingParams(temperature=0), bomb), RowSampler(SamplingParams())]
    tokens_, failures = SamplingBatch(rows).draw(logits)
    assert int(tokens_[0]) == a and failures == {0: FailureReason.GRAMMAR_FAILED}
    assert "too many expressions" in (rows[0].failure or "") and rows[0].failure == bomb.failure
    for call in (bomb.allowed, lambda: bomb.complete, lambda: bomb.advance(a)):
        with pytest.raises(GrammarError, match="too many expressions"):
            call()
    monkeypatch.setattr(model.grammar, "MASK_BUDGET", 1e-4)
    costly = GrammarMatcher(tokens, grammar_of("regex", "((a{80}){80}){4}"))
    with pytest.raises(GrammarError, match="ms of CPU to compute"):
        costly.advance(allowed_ids(costly.allowed())[0])
    mask_memo.cache_clear()


def test_a_matcher_is_ready_once_compiled_and_a_compile_error_is_its_failure(
    tiny_tokenizer: Tokenizer,
) -> None:
    tokens = grammar_tokenizer(tiny_tokenizer, tiny_tokenizer.token_to_id("<|eos|>"))
    loop = GrammarMatcher(tokens, grammar_of("json", LOOP))
    deadline = time.monotonic() + 10
    while not loop.ready and time.monotonic() < deadline:
        time.sleep(0.001)
    assert loop.ready and loop.failure is None  # not taken yet
    with pytest.raises(GrammarError, match="no output can match it"):
        loop.allowed()
    assert loop.failure is not None and "no output can match it" in loop.failure
