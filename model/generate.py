"""Generating text offline with the decode core (``model.decode.DecodeBatch``), the same one the
server's engine drives: prefill once, then one cached step per new token.

``SequenceState`` is the per-sequence bookkeeping shared by offline ``generate()`` and the
service's continuous-batching engine: it appends sampled tokens, turns them into text that never
splits a UTF-8 character, and stops on EOS, a stop string (never partly emitted) or the token
budget.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer

from model.decode import DecodeBatch, Row, Sampled, Tokens
from model.grammar import constraint_of
from model.sampling import RowSampler, raise_if_failed
from model.sampling_params import SamplingParams
from model.speculative import Speculation
from model.tokenizer import IncrementalDecoder, encode_prompt, special_ids
from model.transformer import Transformer

GREEDY = SamplingParams(temperature=0.0)


class StopMatcher:
    """Finds stop strings in streamed text, holding back any tail that could start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [stop for stop in stops if stop]
        self.pending = ""
        self.matched: str | None = None  # the stop string reached (the earliest, if several)

    def push(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return (text safe to emit now, whether a stop string was reached)."""
        if not self.stops:  # nothing to hold back (the engine's commonest case, once a token)
            return text, False
        self.pending += text
        hits = [(index, stop) for stop in self.stops if (index := self.pending.find(stop)) >= 0]
        if hits:
            index, self.matched = min(hits)
            emitted, self.pending = self.pending[:index], ""
            return emitted, True
        held = self._longest_partial_stop()
        cut = len(self.pending) - held
        emitted, self.pending = self.pending[:cut], self.pending[cut:]
        return emitted, False

    def flush(self) -> str:
        """Release held-back text once the sequence ends for another reason."""
        emitted, self.pending = self.pending, ""
        return emitted

    def _longest_partial_stop(self) -> int:
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(self.pending)), longest, -1):
                if self.pending.endswith(stop[:size]):
                    longest = size
                    break
        return longest


@dataclass
class SequenceState:
    """One sequence being generated: its tokens, its text so far and why it stopped."""

    prompt_ids: list[int]
    max_new_tokens: int
    decoder: IncrementalDecoder
    stop: StopMatcher
    eos_id: int | None  # None: <|eos|> is an ordinary token (its text is empty)
    generated_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length" once finished

    @classmethod
    def start(
        cls,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        max_new_tokens: int,
        stop: Sequence[str] = (),
    ) -> SequenceState:
        return cls(
            prompt_ids=list(prompt_ids),
            max_new_tokens=max_new_tokens,
            decoder=IncrementalDecoder(tokenizer),
            stop=StopMatcher(stop),
            eos_id=special_ids(tokenizer).eos,
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int, complete: bool = False) -> str:
        """Record a sampled token; return the text it completes (may be empty). ``complete``:
        the sequence's grammar allows nothing more (``RowSampler.complete``), so it ends here."""
        self.generated_ids.append(token_id)
        if token_id == self.eos_id:
            text, reason = self.decoder.flush(), "stop"
        else:
            text, reason = self.decoder.push(token_id), None
            if complete:
                text, reason = text + self.decoder.flush(), "stop"
            elif len(self.generated_ids) >= self.max_new_tokens:
                text, reason = text + self.decoder.flush(), "length"
        emitted, hit_stop = self.stop.push(text)
        if hit_stop:
            reason = "stop"
        elif reason is not None:
            emitted += self.stop.flush()  # nothing more can complete a stop string
        self.text += emitted
        self.finish_reason = reason
        return emitted


@dataclass(frozen=True)
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


def _check_room(model: Transformer, longest: int, max_new_tokens: int) -> None:
    limit = model.positional.max_positions
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"'{model.config.scheme}' scheme's max_positions ({limit})"
        )


def _start(
    model: Transformer,
    rows: list[Row],
    max_new_tokens: int,
    vocab: int,
    pad_id: int,
    speculation: Speculation | None = None,
) -> tuple[DecodeBatch, Sampled | None]:
    """A batch holding ``rows``, their prompts prefilled in one ragged pass, and its first draw."""
    longest = max(len(row.tokens.prompt_ids) for row in rows)
    _check_room(model, longest, max_new_tokens)
    batch: DecodeBatch[Row] = DecodeBatch(
        model, len(rows), longest + max_new_tokens, vocab, pad_id, speculation=speculation
    )
    return batch, batch.step([(row, len(row.tokens.prompt_ids)) for row in rows])


def _sample_all(sampled: Sampled) -> list[int]:
    """The draw's tokens; offline, a row that cannot be sampled is an error for the caller."""
    raise_if_failed(sampled.failures)
    return sampled.tokens


@torch.inference_mode()
def decode_tokens(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    params: SamplingParams | Sequence[SamplingParams] = GREEDY,
    pad_id: int = 0,
) -> Iterator[list[int]]:
    """Prefill ``prompts`` in one ragged pass, then yield the next token id of every row at
    every step, ``max_new_tokens`` times (no row stops early: the raw decode loop).

    Each step is one cached forward for the whole batch, through the same ``DecodeBatch`` the
    server decodes with. Stop iterating to stop decoding.
    """
    settings = _per_row(params, len(prompts))
    rows = [Row(Tokens(list(p), []), RowSampler(s)) for p, s in zip(prompts, settings, strict=True)]
    batch, sampled = _start(model, rows, max_new_tokens, model.config.vocab_size, pad_id)
    for step in range(max_new_tokens):
        assert sampled is not None
        tokens = _sample_all(sampled)
        yield tokens
        if step + 1 == max_new_tokens:
            return
        for row, token in zip(sampled.rows, tokens, strict=True):
            row.tokens.generated_ids.append(token)
        sampled = batch.step()


def _per_row(
    sampling: SamplingParams | Sequence[SamplingParams], rows: int
) -> list[SamplingParams]:
    params = [sampling] * rows if isinstance(sampling, SamplingParams) else list(sampling)
    if len(params) != rows:
        raise ValueError(f"got {len(params)} sampling settings for {rows} prompts")
    return params


@torch.inference_mode()
def generate(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: Sequence[str | Sequence[int]],
    *,
    max_new_tokens: int = 64,
    sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
    stop: Sequence[str] = (),
    speculation: Speculation | None = None,
) -> list[Completion]:
    """Generate a completion for each prompt, all rows decoded together with one KV cache.

    Prompts of different lengths are prefilled in one ragged pass; then each step runs one cached
    forward for the rows still generating. A row stops (and leaves the batch) on <|eos|>, a stop
    string or ``max_new_tokens``. ``sampling`` is one SamplingParams for all rows or one per
    row. Tokens past the tokenizer's vocabulary (padding rows of the embedding) are never drawn.
    ``speculation``: decode by exact n-gram speculation (``model.speculative``): the same
    completions, in fewer steps where the text repeats itself.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    params = _per_row(sampling, len(prompts))
    states = [
        SequenceState.start(tokenizer, encode_prompt(tokenizer, p), max_new_tokens, stop)
        for p in prompts
    ]
    eos = special_ids(tokenizer).eos
    rows = [
        Row(state, RowSampler(p, constraint_of(p, tokenizer, eos)), max_new_tokens=max_new_tokens)
        for state, p in zip(states, params, strict=True)
    ]
    vocab = min(tokenizer.get_vocab_size(), model.config.vocab_size)
    pad = special_ids(tokenizer).pad
    batch, sampled = _start(model, rows, max_new_tokens, vocab, pad, speculation)
    while sampled is not None:
        finished = []
        _sample_all(sampled)
        for position, row in enumerate(sampled.rows):
            state = row.tokens
            assert isinstance(state, SequenceState)
            for token in sampled.new_tokens(position):
                state.append(token, row.sampler.complete)
                if state.finished:
                    finished.append(row)
                    break
        batch.remove(finished)
        sampled = batch.step()
    return [
        Completion(s.prompt_ids, s.generated_ids, s.text, s.finish_reason or "length")
        for s in states
    ]
