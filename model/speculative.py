"""Speculative decoding by n-gram prompt lookup (vLLM's ``ngram`` method, llama.cpp's lookup
decoding), exact.

A decoding row whose last tokens occurred earlier in its prompt or output proposes the up to K
tokens that followed them there (:class:`NgramLookup`). ``DecodeBatch.step`` then feeds the row
its last sampled token *and* the K drafts, as K + 1 pass rows of the decode kernel, and gets the
logits at each of the K + 1 positions in the one pass that decodes every other row.

Verification draws each position's token as decoding without speculation would: the same
sampler, the same filters and, for a seeded row, the same uniform, position after position. A
draft is kept while it equals the token drawn at its position; the first token that differs, or
the one after the last draft, is the step's own new token. With a draft that proposes one token
for certain this *is* standard rejection sampling (accept draft d with probability p(d), else
draw from p without d, renormalised: P(emit x) = p(x) for every x), and it keeps more: the
uniforms of the positions past the first difference go back to the row's generator, so a seeded
row's tokens are the tokens it draws without speculation. Greedy rows compare argmaxes.

Exact needs each position's logits to be those of a one-token step, bit for bit. The decode
kernel computes every pass row on its own (a pass row's numbers are the same in any call), and
a ``prefix_stable`` scheme's cached entries do not depend on the pass that wrote them; the keys
written for rejected drafts are dropped by shortening the row (``KVCache.lengths``). Where either
fails (the torch blocks, whose matrix products sum a K-token pass in another order; rope's
dynamic scaling, which rotates by the pass's length), :func:`refusal` says why and the model
decodes one token a step. A row speculates only when its next distribution depends on its
logits alone (no grammar, no penalty on earlier tokens) and it reports no logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from model.sampling import RowSampler

if TYPE_CHECKING:
    from model.transformer import Transformer

METHODS = ("ngram",)
MAX_WAIT = 16  # the most steps a row that keeps missing waits between proposals


@dataclass(frozen=True)
class Speculation:
    """How rows speculate: up to ``tokens`` drafts a step, from the longest earlier match of
    their last ``ngram_max`` down to ``ngram_min`` tokens (vLLM's ``num_speculative_tokens``,
    ``prompt_lookup_max`` and ``prompt_lookup_min``)."""

    tokens: int
    ngram_max: int = 4
    ngram_min: int = 2
    method: str = "ngram"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {METHODS}")
        if self.tokens < 1:
            raise ValueError(f"num_speculative_tokens must be ≥ 1, got {self.tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"prompt lookup needs 1 ≤ min ≤ max, got {self.ngram_min}, {self.ngram_max}"
            )


def refusal(model: Transformer) -> str | None:
    """Why ``model`` cannot verify drafts exactly here, or None when it can."""
    scheme = model.positional
    if not scheme.prefix_stable:
        return (
            f"the {scheme.name!r} scheme as configured is not prefix-stable (its cached keys "
            "depend on the pass that wrote them), so K drafts in one pass would not give the "
            "logits of K one-token steps"
        )
    backend = model.decode_backend
    if backend != "cpu-kernel":
        return (
            f"its decode backend is {backend}: only the CPU decode kernel computes each position "
            "of a multi-token pass exactly as a one-token step"
        )
    return None


def speculates(sampler: RowSampler, logprobs: int | None) -> bool:
    """Whether a row with ``sampler`` (reporting ``logprobs``) may speculate: its next
    distribution must depend on its logits alone."""
    return logprobs is None and not sampler.reads_history


class NgramLookup:
    """One sequence's tokens, indexed by their n-grams (n in ``ngram_min``..``ngram_max``), so
    that a proposal costs a few dictionary lookups however long the sequence is."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.tokens: list[int] = []
        self.generated = 0  # how many of the sequence's generated tokens are in ``tokens``
        # n-gram → the index just past its latest occurrence that is not the sequence's end
        self._after: dict[tuple[int, ...], int] = {}
        # Back-off: after a proposal that kept nothing the row waits 1, 2, 4 … 16 steps before it
        # proposes again, so that text that does not repeat itself pays for few verifications.
        self._misses = 0
        self._wait = 0

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the sequence."""
        for token in tokens:
            self._index_end()
            self.tokens.append(token)

    def catch_up(self, prompt_ids: Sequence[int], generated_ids: Sequence[int]) -> None:
        """Bring the index up to a sequence of ``prompt_ids`` then ``generated_ids`` (which only
        grows)."""
        if not self.tokens:
            self.extend(prompt_ids)
        self.extend(generated_ids[self.generated :])
        self.generated = len(generated_ids)

    def propose(self, most: int) -> list[int]:
        """Up to ``most`` tokens that followed the latest earlier occurrence of the longest
        suffix n-gram that occurred before (empty: none did, or the row is backing off)."""
        if self._wait:
            self._wait -= 1
            return []
        tokens = self.tokens
        for n in range(min(self.ngram_max, len(tokens)), self.ngram_min - 1, -1):
            after = self._after.get(tuple(tokens[-n:]))
            if after is not None:
                return tokens[after : after + most]
        return []

    def verified(self, kept: int) -> None:
        """The last proposal kept ``kept`` tokens: none, and the row backs off for longer."""
        if kept:
            self._misses = 0
        else:
            self._wait = min(2**self._misses, MAX_WAIT)
            self._misses += 1

    def _index_end(self) -> None:
        """Index the n-grams that end the sequence now, before a token follows them."""
        tokens, end = self.tokens, len(self.tokens)
        for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
            self._after[tuple(tokens[end - n :])] = end
