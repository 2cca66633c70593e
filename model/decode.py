"""The one decode core: sequences of one model decoded together in rows of one KV cache.

Offline ``generate()`` and the server's engine both drive a :class:`DecodeBatch`. One
:meth:`DecodeBatch.step`:

1. runs one cached forward over the *decoding* rows, each fed the token it sampled last;
2. runs one ragged forward over the prompt chunks it is given: new sequences join at the next
   free rows, and a prompt may arrive in several chunks (chunked prefill, so that a long prompt
   never stalls the rows already decoding for more than one chunk). Where the decode kernel
   applies (``model.kernels.decode_step``), 1 and 2 are one pass: each prompt token is a pass
   row of its own beside the decoding rows (``KVCache.entries``), as vLLM batches prefill and
   decode tokens together;
3. samples, in one :class:`~model.sampling.SamplingBatch` call (the one place sampling is
   applied), the decoding rows and the rows whose prompt is now complete.

With ``speculation`` (``model.speculative``), a decoding row whose last tokens occurred before
is also fed the tokens that followed them there, as more pass rows in 1-2; 3 then draws its
positions in turn and keeps the drafts its draws confirm (:meth:`DecodeBatch._verify`).

The caller records each sampled token in its sequence (``generated_ids``) and says which rows
leave (:meth:`DecodeBatch.remove`). Rows are kept in order: decoding rows first, rows still
prefilling after them, so each forward covers one slice of the cache. When a row leaves, the
last decoding row moves into its slot and the prefilling rows shift down behind it
(``KVCache.move_row``: one copy of the filled slots of each moved row). The per-row sampling
tensors, the logprob rows and the seen-token mask are rebuilt only when the sampled rows change;
the [rows, V] seen mask exists only while some row uses a repetition penalty, and the [rows, V]
counts only while some row uses a frequency or presence penalty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch
from torch import Tensor

from model import captured
from model.cache import KVCache
from model.kernels import decode_step
from model.sampling import RowSampler, SamplingBatch, token_logprobs
from model.sampling_params import FailureReason
from model.speculative import NgramLookup, Speculation, refusal, speculates
from model.transformer import Transformer

GROW_FROM = (4, 64)  # (rows, positions) a growing cache starts with

# (positions in Sampled.rows asking for logprobs, chosen logprob of each, top values, top ids)
StepLogprobs = tuple[list[int], list[float], list[list[float]], list[list[int]]]


class TokenHistory(Protocol):
    """A sequence's tokens: its prompt and what was sampled for it (``SequenceState`` is one)."""

    prompt_ids: list[int]
    generated_ids: list[int]


@dataclass
class Tokens:
    """The plainest :class:`TokenHistory`, for callers that keep no text."""

    prompt_ids: list[int]
    generated_ids: list[int]


@dataclass(eq=False)
class Row:
    """One sequence as the batch sees it. ``tokens`` belongs to the caller, who appends each
    sampled token to ``tokens.generated_ids``; the batch reads it only to rebuild its masks.

    ``logprobs``: how many top logprobs to report per sampled token (None: no logprobs).
    ``max_new_tokens``: the most tokens it may generate, whose slots a growing cache allocates
    when it joins (None: only its first). ``index`` is the row's slot in the cache while it
    holds one (None before and after). ``lookup``: its tokens' n-grams, once it speculates.
    """

    tokens: TokenHistory
    sampler: RowSampler
    logprobs: int | None = None
    max_new_tokens: int | None = None
    index: int | None = None
    lookup: NgramLookup | None = None


R = TypeVar("R", bound=Row)  # the caller's row type (the engine's Request is a Row)


@dataclass(frozen=True)
class Sampled(Generic[R]):
    """One step's draw: a token for each of ``rows`` (in row order), and the rows that failed
    (position in ``rows`` → why; their token is meaningless and they should leave).

    A row that speculated (``model.speculative``) offered ``drafted[position]`` draft tokens;
    those it kept, ``accepted[position]``, come before its token: the row's new tokens are
    ``accepted.get(position, []) + [tokens[position]]``."""

    rows: list[R]
    tokens: list[int]
    failures: dict[int, FailureReason]
    logprobs: StepLogprobs | None
    drafted: dict[int, int] = field(default_factory=dict)
    accepted: dict[int, list[int]] = field(default_factory=dict)

    def new_tokens(self, position: int) -> list[int]:
        """The tokens row ``position`` gained this step, in order."""
        return [*self.accepted.get(position, ()), self.tokens[position]]


class DecodeBatch(Generic[R]):
    """Up to ``max_rows`` sequences of ``model``, each at most ``max_length`` tokens long.

    ``vocab`` is the tokenizer's vocabulary: logits past it (padding rows of the embedding) are
    never sampled or scored. ``filler`` pads ragged prompt chunks; any id works since padding
    is neither stored nor attended to, and <|bos|> (which every prompt holds) keeps the seen
    mask exact. ``grow``: allocate the cache for a few short rows and grow it on demand (a
    server, whose batch is mostly not full); :meth:`shrink` gives it back once the batch is
    empty (the server waits until a model has been idle a while: allocating and zeroing the
    cache again for the next request cost ~1 ms of its time to first token). ``graphs``:
    replay decode steps from CUDA graphs (``model.captured``; None: on a GPU unless
    ``ORDINAL_CUDA_GRAPHS=0``). ``speculation``: rows that can speculate propose drafts by
    n-gram lookup and verify them in the step's pass (``model.speculative``; ValueError if
    the model cannot verify exactly: ``model.speculative.refusal``).
    """

    def __init__(
        self,
        model: Transformer,
        max_rows: int,
        max_length: int,
        vocab: int,
        filler: int,
        *,
        grow: bool = False,
        graphs: bool | None = None,
        speculation: Speculation | None = None,
    ) -> None:
        weights = model.token_embedding.weight
        self.model = model
        self.device = weights.device
        self.vocab = vocab
        self.filler = filler
        reserve = (min(max_rows, GROW_FROM[0]), min(max_length, GROW_FROM[1])) if grow else None
        self.cache = KVCache(
            model.config, max_rows, max_length, self.device, weights.dtype, reserve=reserve
        )
        self.members: list[R] = []  # members[i] is in cache row i
        self.decoding = 0  # members[:decoding] decode; the rest are still prefilling
        self.inputs = torch.zeros(max_rows, dtype=torch.long, device=self.device)  # next token fed
        self.seen: Tensor | None = None  # [max_rows, vocab] bool, only while a penalty is in use
        self.counts: Tensor | None = None  # [max_rows, vocab] float: tokens generated
        self._sampling: SamplingBatch | None = None
        self._logprob_rows: Tensor | None = None
        self._logprob_top = 0
        self._changed = False
        # Decode steps replayed from CUDA graphs (model.captured): by default on a GPU only.
        # graphs=True off a GPU runs the same fixed-shape steps eagerly (the tests do).
        if graphs is None:
            graphs = captured.wanted(self.device)
        self.captured = (
            captured.CapturedDecode(
                model, self.cache, self.inputs, replay=self.device.type == "cuda"
            )
            if graphs
            else None
        )
        if speculation is not None and (why := refusal(model)) is not None:
            raise ValueError(f"speculative decoding: {why}")
        self.speculation = speculation
        # the samplers of the rows still verifying drafts, by those rows (kept as _sampling is)
        self._verifying: dict[tuple[int, ...], SamplingBatch] = {}

    def __len__(self) -> int:
        return len(self.members)

    @property
    def free(self) -> int:
        return self.cache.rows - len(self.members)

    def step(self, chunks: Sequence[tuple[R, int]] = ()) -> Sampled[R] | None:
        """One decode step; ``chunks`` = (row, how many of its next prompt tokens to prefill).

        A chunk's row is either new (it joins at the next free row) or the row still
        prefilling; chunks come in row order and only the last may leave its prompt unfinished.
        Returns the draw of the decoding rows, or None when no row could sample (only a partial
        prompt was prefilled).
        """
        drafts = self._propose() if self.speculation and self.decoding and self._on_kernel() else {}
        if drafts:
            logits = self._decode_with_prompts(chunks, drafts)
            return self._verify(logits, drafts)
        if chunks and self._on_kernel():
            logits = self._decode_with_prompts(chunks)
            return self._sample(logits) if self.decoding else None
        parts = [self._decode()] if self.decoding else []
        if chunks:
            parts.append(self._prefill(chunks))
        if not self.decoding:
            return None
        return self._sample(torch.cat(parts) if len(parts) > 1 else parts[0])

    def _on_kernel(self) -> bool:
        """Whether this step's pass can be the decode kernel's (``decode_step.applies``)."""
        return self.captured is None and decode_step.applies(self.model, self.inputs[:1, None])

    def join(self, row: R) -> int:
        """``row`` takes the next free cache row now rather than with its first chunk, so that
        its first slots can be filled before (``KVCache.fill``: a reused prefix, whose chunks
        then start after it); returns that cache row. Rows join in the order their chunks
        come."""
        if row.index is not None or not self.free:
            raise ValueError("only a row outside the batch may join, while a row is free")
        self._seat([row])
        return len(self.members) - 1

    def _seat(self, joining: Sequence[R]) -> None:
        """``joining`` take the next free cache rows, with room at once (one reallocation at
        most) for every slot they may fill: prompt and ``max_new_tokens``. So a growing cache
        grows in the step that admits a row, a prefill, and not in the middle of decoding,
        where one reallocation stops every row (32 rows from 128 to 256 slots: ~20 ms, ten
        steps' time, most of it the page faults of fresh memory)."""
        for row in joining:
            row.index = len(self.members)
            self.members.append(row)
        final = (len(row.tokens.prompt_ids) + (row.max_new_tokens or 1) for row in joining)
        self.cache.reserve(len(self.members), min(max(final, default=0), self.cache.max_length))

    def _decode(self) -> Tensor:
        """One cached step for every decoding row, fed its last sampled token → logits [d, V]."""
        n = self.decoding
        if self.captured is not None:
            logits = self.captured.logits(n)
            if logits is not None:
                return logits[:, : self.vocab]
        tokens = self.inputs[:n].unsqueeze(1)
        return self.model(tokens, self.cache, rows=slice(0, n), last_only=True)[:, : self.vocab]

    def _decode_with_prompts(
        self, chunks: Sequence[tuple[R, int]], drafts: dict[int, list[int]] | None = None
    ) -> Tensor:
        """The decoding rows and the chunks' prompt tokens in one decode kernel pass, each prompt
        token a pass row of its own (``KVCache.entries``) → logits [c, V] of the decoding rows
        and of the rows whose prompt this completes (the last token of each). A decoding row
        with ``drafts`` (row → its draft tokens) is fed them after its own token, and has the
        logits of each of those positions, in order.

        Where the kernel applies, every prompt is prefilled this way, alone or beside decoding
        rows, so a seeded row's numbers do not depend on what shares its batch. A 32-token
        prompt through the torch blocks took 1.3-1.4 ms, longer than a whole 31-row decode step;
        beside those rows in the pass it adds 0.45-0.55 ms (docs/performance.md, thirteenth
        round)."""
        begins = self._check(chunks)
        self._seat([row for row, _ in chunks if row.index is None])
        counts = [count for _, count in chunks]
        fed = self.inputs[: self.decoding].tolist()  # each decoding row's token, then drafts
        own = [1] * self.decoding
        if drafts:
            own = [1 + len(drafts.get(row, ())) for row in range(self.decoding)]
            fed = [token for row, last in enumerate(fed) for token in (last, *drafts.get(row, ()))]
        decoding_rows = len(fed)  # pass rows of the decoding rows, before the prompts'
        for (row, count), begin in zip(chunks, begins, strict=True):
            fed += row.tokens.prompt_ids[begin : begin + count]
        plan = self.cache.entries(own + counts)
        tokens = torch.tensor(fed, dtype=torch.long, device=self.device).unsqueeze(1)
        complete = self._completed(chunks, begins)
        wanted = None  # the rows that sample: all of them, without a prompt left unfinished
        if complete < len(chunks) or any(count > 1 for count in counts):
            lasts = torch.tensor(counts[:complete], dtype=torch.long).cumsum(0) - 1 + decoding_rows
            wanted = torch.cat((torch.arange(decoding_rows), lasts))
        logits = self.model.decode_entries(tokens, self.cache, plan, wanted)
        self._start_decoding([row for row, _ in chunks[:complete]])
        return logits[:, : self.vocab]

    def _prefill(self, chunks: Sequence[tuple[R, int]]) -> Tensor:
        """Feed each chunk's prompt tokens in one ragged pass → logits [c, V] of the c rows
        whose prompt this completes (a prefix of ``chunks``)."""
        begins = self._check(chunks)
        rows = slice(self.decoding, self.decoding + len(chunks))
        self._seat([row for row, _ in chunks if row.index is None])
        counts = [count for _, count in chunks]
        prompts = torch.full((len(chunks), max(counts)), self.filler, dtype=torch.long)
        for index, ((row, count), begin) in enumerate(zip(chunks, begins, strict=True)):
            prompts[index, :count] = torch.tensor(row.tokens.prompt_ids[begin : begin + count])
        logits = self.model(
            prompts.to(self.device),
            self.cache,
            rows=rows,
            new_counts=torch.tensor(counts) if len(set(counts)) > 1 else None,
            last_only=True,
        )
        complete = self._completed(chunks, begins)
        self._start_decoding([row for row, _ in chunks[:complete]])
        return logits[:complete, : self.vocab]

    @staticmethod
    def _completed(chunks: Sequence[tuple[R, int]], begins: list[int]) -> int:
        """How many of ``chunks`` (starting at ``begins`` in their prompts) end their prompt:
        a prefix of them, since only the last chunk may leave its prompt unfinished."""
        return sum(
            begin + count == len(row.tokens.prompt_ids)
            for (row, count), begin in zip(chunks, begins, strict=True)
        )

    def _check(self, chunks: Sequence[tuple[R, int]]) -> list[int]:
        """Where each chunk starts in its prompt; ValueError (and nothing changed) unless the
        chunks are the prefilling rows in order, then new rows that fit, and only the last
        leaves its prompt unfinished."""
        held = [row for row, _ in chunks if row.index is not None]
        if [row.index for row in held] != list(range(self.decoding, self.decoding + len(held))):
            raise ValueError("chunks must be the prefilling rows, in order, then new rows")
        if any(row.index is not None for row, _ in chunks[len(held) :]):
            raise ValueError("chunks must be the prefilling rows, in order, then new rows")
        if len(self.members) + len(chunks) - len(held) > self.cache.rows:
            raise ValueError(f"more sequences than the batch's {self.cache.rows} rows")
        begins = [
            0 if row.index is None else int(self.cache.lengths[row.index]) for row, _ in chunks
        ]
        for position, ((row, count), begin) in enumerate(zip(chunks, begins, strict=True)):
            end, length = begin + count, len(row.tokens.prompt_ids)
            if count < 1 or end > length or (end < length and position < len(chunks) - 1):
                raise ValueError("only the last chunk may leave its prompt unfinished")
        return begins

    def _start_decoding(self, rows: list[R]) -> None:
        """``rows`` (the next after the decoding rows) have their whole prompt in the cache."""
        if not rows:
            return
        span = slice(self.decoding, self.decoding + len(rows))
        self.decoding += len(rows)
        if self.seen is not None:
            self.seen[span] = False
            for row in rows:
                assert row.index is not None
                self.seen[row.index, torch.tensor(row.tokens.prompt_ids)] = True
        if self.counts is not None:
            self.counts[span] = 0
        self._changed = True

    def _sample(self, logits: Tensor) -> Sampled[R]:
        """Draw every decoding row's next token from ``logits`` [d, V]; it is fed next step.

        A row that cannot be sampled is reported in ``failures`` (its token becomes
        ``filler``, so the seen mask and the logprobs stay in range); the other rows' tokens
        are unaffected.
        """
        if self._changed:
            self._refresh()
        n = self.decoding
        seen = None if self.seen is None else self.seen[:n]
        counts = None if self.counts is None else self.counts[:n]
        assert self._sampling is not None
        tokens, failures = self._sampling.draw(logits, seen, counts)
        if failures:
            tokens[list(failures)] = self.filler
        if seen is not None:
            seen.scatter_(1, tokens.unsqueeze(1), True)
        if counts is not None:
            counts.scatter_add_(1, tokens.unsqueeze(1), torch.ones_like(counts[:, :1]))
        self.inputs[:n] = tokens
        return Sampled(self.members[:n], tokens.tolist(), failures, self._logprobs(logits, tokens))

    def _propose(self) -> dict[int, list[int]]:
        """Each speculating decoding row's draft tokens (row → drafts; rows without any left
        out), as many as its token budget and the cache leave room for after its next token."""
        assert self.speculation is not None
        spec, drafts = self.speculation, {}
        lengths = self.cache.lengths[: self.decoding].tolist()
        for index, row in enumerate(self.members[: self.decoding]):
            if not speculates(row.sampler, row.logprobs):
                continue
            history = row.tokens
            room = min(spec.tokens, self.cache.max_length - lengths[index] - 1)
            if row.max_new_tokens is not None:
                room = min(room, row.max_new_tokens - len(history.generated_ids) - 1)
            if room < 1:
                continue
            if row.lookup is None:
                row.lookup = NgramLookup(spec.ngram_min, spec.ngram_max)
            row.lookup.catch_up(history.prompt_ids, history.generated_ids)
            if proposal := row.lookup.propose(room):
                drafts[index] = proposal
        return drafts

    def _verify(self, logits: Tensor, drafts: dict[int, list[int]]) -> Sampled[R]:
        """Draw every decoding row's next tokens from ``logits`` [P, V], P = each row's
        positions (1 + its drafts) in row order (``model.speculative``): first every row's
        first position, as a step without drafts draws it; then, while a row's draws equal its
        drafts, its next position. A row shortens its cache by the drafts it did not keep."""
        n = self.decoding
        firsts, position = [], 0  # each row's first position in logits
        for row in range(n):
            firsts.append(position)
            position += 1 + len(drafts.get(row, ()))
        first = self._sample(logits[firsts])
        tokens, failures = list(first.tokens), dict(first.failures)
        accepted: dict[int, list[int]] = {}
        alive = [row for row, drafted in drafts.items() if tokens[row] == drafted[0]]
        position = 1
        while alive := [row for row in alive if row not in failures]:
            for row in alive:
                accepted.setdefault(row, []).append(tokens[row])
            rows = tuple(alive)
            sampling = self._verifying.get(rows)
            if sampling is None:
                sampling = SamplingBatch([self.members[row].sampler for row in rows], self.device)
                self._verifying[rows] = sampling
            draw = sampling.draw(logits[[firsts[row] + position for row in rows]])
            drawn = draw.tokens.tolist()
            for index, row in enumerate(rows):
                tokens[row] = drawn[index]
                if index in draw.failures:
                    failures[row], tokens[row] = draw.failures[index], self.filler
            alive = [
                row
                for row in rows
                if position < len(drafts[row]) and tokens[row] == drafts[row][position]
            ]
            position += 1
        for row in drafts:
            if (lookup := self.members[row].lookup) is not None:
                lookup.verified(len(accepted.get(row, ())))
        discarded = [len(drafts.get(row, ())) - len(accepted.get(row, ())) for row in range(n)]
        self.cache.lengths[:n] -= torch.tensor(discarded)
        for row, kept in accepted.items():
            self.inputs[row] = tokens[row]
            if self.seen is not None or self.counts is not None:
                self._note_drawn(row, [*kept[1:], tokens[row]])  # the first is noted
        drafted = {row: len(proposal) for row, proposal in drafts.items()}
        return Sampled(first.rows, tokens, failures, first.logprobs, drafted, accepted)

    def _note_drawn(self, row: int, tokens: list[int]) -> None:
        """Mark ``tokens``, drawn for ``row``, in the seen mask and the counts (where kept)."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        if self.seen is not None:
            self.seen[row, ids] = True
        if self.counts is not None:
            self.counts[row].scatter_add_(0, ids, torch.ones_like(ids, dtype=self.counts.dtype))

    def _logprobs(self, logits: Tensor, tokens: Tensor) -> StepLogprobs | None:
        """Raw-model logprobs of ``tokens`` for the rows that asked for them, or None."""
        if self._logprob_rows is None:
            return None
        rows = self._logprob_rows
        chosen, top_values, top_ids = token_logprobs(logits[rows], tokens[rows], self._logprob_top)
        return rows.tolist(), chosen.tolist(), top_values.tolist(), top_ids.tolist()

    def score(self, prompt_ids: list[int], top_n: int) -> tuple[Tensor, Tensor, Tensor]:
        """Logprobs of every prompt token after the first, from one full forward (no cache).

        Returns (chosen [T-1], top values [T-1, top_n], top ids [T-1, top_n]).
        """
        ids = torch.tensor(prompt_ids, device=self.device)
        logits = self.model(ids.unsqueeze(0))[0, :-1, : self.vocab]
        return token_logprobs(logits, ids[1:], top_n)

    def remove(self, leaving: Sequence[R]) -> None:
        """Drop ``leaving``: the last decoding row fills each freed decoding slot, and the rows
        still prefilling shift down behind it, so both groups stay contiguous."""
        if not leaving:  # nothing changes: keep the sampler built for these rows
            return
        for row in sorted(leaving, key=lambda row: row.index or 0, reverse=True):
            hole = row.index
            assert hole is not None and self.members[hole] is row
            if hole < self.decoding:
                self.decoding -= 1
                self._move(self.decoding, hole)
                hole = self.decoding
            for later in range(hole + 1, len(self.members)):
                self._move(later, later - 1)
            self.members.pop()
            self.cache.reset(len(self.members))
            row.index = None
        self._changed = True

    def shrink(self) -> None:
        """Give the cache's growth back, if no sequence is in the batch."""
        if not self.members:
            self.cache.release()

    def _move(self, source: int, target: int) -> None:
        """Row ``source``'s sequence moves to row ``target`` (whose sequence has left)."""
        if source == target:
            return
        moved = self.members[source]
        self.cache.move_row(source, target)
        self.inputs[target] = self.inputs[source]
        if self.seen is not None:
            self.seen[target] = self.seen[source]
        if self.counts is not None:
            self.counts[target] = self.counts[source]
        self.members[target], moved.index = moved, target

    def clear(self) -> list[R]:
        """Forget every row (after a failed step); returns the rows that were in the batch."""
        rows, self.members, self.decoding = self.members, [], 0
        self.cache.lengths.zero_()
        self.cache.release()
        for row in rows:
            row.index = None
        self.seen, self.counts, self._changed = None, None, True
        return rows

    def _refresh(self) -> None:
        """Rebuild what depends on the sampled rows: sampling tensors, logprob rows, masks."""
        self._changed = False
        self._verifying.clear()
        sampled = self.members[: self.decoding]
        if not sampled:
            self._sampling, self._logprob_rows, self.seen, self.counts = None, None, None, None
            return
        self._sampling = SamplingBatch([row.sampler for row in sampled], self.device)
        wanted = [index for index, row in enumerate(sampled) if row.logprobs is not None]
        self._logprob_rows = torch.tensor(wanted, device=self.device) if wanted else None
        self._logprob_top = max((row.logprobs or 0 for row in sampled), default=0)
        if not self._sampling.uses_penalty:
            self.seen = None
        elif self.seen is None:
            self.seen = self._seen_of(sampled)
        if not self._sampling.uses_counts:
            self.counts = None
        elif self.counts is None:
            self.counts = self._counts_of(sampled)

    def _seen_of(self, rows: Sequence[Row]) -> Tensor:
        """The seen mask [max_rows, vocab] rebuilt from each row's prompt and generated tokens."""
        seen = torch.zeros(self.cache.rows, self.vocab, dtype=torch.bool, device=self.device)
        for row in rows:
            ids = [*row.tokens.prompt_ids, *row.tokens.generated_ids]
            seen[row.index, torch.tensor(ids, device=self.device)] = True
        return seen

    def _counts_of(self, rows: Sequence[Row]) -> Tensor:
        """The generated-token counts [max_rows, vocab] rebuilt from each row's tokens."""
        counts = torch.zeros(self.cache.rows, self.vocab, device=self.device)
        for row in rows:
            generated = torch.tensor(row.tokens.generated_ids, dtype=torch.long, device=self.device)
            counts[row.index].scatter_add_(
                0, generated, torch.ones_like(generated, dtype=counts.dtype)
            )
        return counts
