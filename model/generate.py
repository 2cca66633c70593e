"""Generating text with the KV cache: prefill once, then one cached step per new token.

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

from model.cache import KVCache
from model.sampling import RowSampler, SamplingBatch, SamplingParams
from model.tokenizer import IncrementalDecoder, special_ids
from model.transformer import Transformer

GREEDY = SamplingParams(temperature=0.0)


class StopMatcher:
    """Finds stop strings in streamed text, holding back any tail that could start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [stop for stop in stops if stop]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return (text safe to emit now, whether a stop string was reached)."""
        self.pending += text
        hits = [index for stop in self.stops if (index := self.pending.find(stop)) >= 0]
        if hits:
            emitted, self.pending = self.pending[: min(hits)], ""
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

    def append(self, token_id: int) -> str:
        """Record a sampled token; return the text it completes (may be empty)."""
        self.generated_ids.append(token_id)
        if token_id == self.eos_id:
            text, reason = self.decoder.flush(), "stop"
        else:
            text, reason = self.decoder.push(token_id), None
            if len(self.generated_ids) >= self.max_new_tokens:
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


def encode_prompt(tokenizer: Tokenizer, prompt: str | Sequence[int]) -> list[int]:
    """Token ids for a prompt, starting with <|bos|> as every training sequence does."""
    bos = special_ids(tokenizer).bos
    ids = tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
    return ids if ids[:1] == [bos] else [bos, *ids]


@torch.inference_mode()
def decode_tokens(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampler: SamplingBatch,
    pad_id: int = 0,
) -> Iterator[torch.Tensor]:
    """Prefill ``prompts`` in one ragged pass, then yield the next token ids [B] at every step.

    Each step is one cached forward for the whole batch; at most ``max_new_tokens`` steps.
    Stop iterating to stop decoding (rows that finished early simply have their tokens ignored).
    """
    longest = max(len(prompt) for prompt in prompts)
    limit = model.positional.max_positions
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"'{model.config.scheme}' scheme's max_positions ({limit})"
        )
    weight = model.token_embedding.weight
    cache = KVCache(
        model.config, len(prompts), longest + max_new_tokens, weight.device, weight.dtype
    )
    prompt_batch = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        prompt_batch[row, : len(prompt)] = torch.as_tensor(prompt)
    counts = torch.tensor([len(prompt) for prompt in prompts])
    prompt_batch = prompt_batch.to(weight.device)
    logits = model(prompt_batch, cache, new_counts=counts, last_only=True)

    seen = None
    if sampler.uses_penalty:
        seen = torch.zeros(len(prompts), model.config.vocab_size, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            seen[row, torch.as_tensor(prompt)] = True
        seen = seen.to(weight.device)
    generated = None  # [B, V] counts, for frequency and presence penalties
    if sampler.uses_counts:
        generated = torch.zeros(len(prompts), model.config.vocab_size, device=weight.device)
    for step in range(max_new_tokens):
        next_ids = sampler.sample(logits, seen, generated)
        yield next_ids
        if step + 1 == max_new_tokens:
            return
        if seen is not None:
            seen.scatter_(1, next_ids.unsqueeze(1), True)
        if generated is not None:
            generated.scatter_add_(1, next_ids.unsqueeze(1), torch.ones_like(generated[:, :1]))
        logits = model(next_ids.unsqueeze(1), cache, last_only=True)


@torch.inference_mode()
def generate(
    model: Transformer,
    tokenizer: Tokenizer,
    prompts: Sequence[str | Sequence[int]],
    *,
    max_new_tokens: int = 64,
    sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
    stop: Sequence[str] = (),
) -> list[Completion]:
    """Generate a completion for each prompt, all rows decoded together with one KV cache.

    Prompts of different lengths are prefilled in one ragged pass; then each step runs one cached
    forward for the whole batch. A row stops on <|eos|>, a stop string or ``max_new_tokens``.
    ``sampling`` is one SamplingParams for all rows or one per row.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
    params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} sampling settings for {len(prompts)} prompts")
    states = [
        SequenceState.start(tokenizer, encode_prompt(tokenizer, p), max_new_tokens, stop)
        for p in prompts
    ]
    sampler = SamplingBatch([RowSampler(p) for p in params], model.token_embedding.weight.device)
    steps = decode_tokens(
        model, [s.prompt_ids for s in states], max_new_tokens, sampler, special_ids(tokenizer).pad
    )
    for next_ids in steps:
        for state, token in zip(states, next_ids.tolist(), strict=True):
            if not state.finished:
                state.append(token)
        if all(state.finished for state in states):
            break
    return [
        Completion(s.prompt_ids, s.generated_ids, s.text, s.finish_reason or "length")
        for s in states
    ]
