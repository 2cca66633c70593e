"""The sequences one model is decoding: rows 0..n-1 of one preallocated KV cache.

Active rows always sit at the front, so a decode step is one forward pass over ``rows=slice(0,
n)``. When a sequence leaves, the last row moves into its slot (``KVCache.move_row``: one copy
of that row's filled slots); the cache is never copied as a whole. The per-row sampling tensors
(``SamplingBatch``), the logprob row index and the seen-token mask are rebuilt only when the
membership changes, and the [rows, V] seen mask exists only while some row uses a repetition
penalty.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.cache import KVCache
from model.sampling import Draw, SamplingBatch, token_logprobs
from model.transformer import Transformer
from server.job import Job

# (rows asking for logprobs, chosen logprob per such row, top values, top ids), as lists
StepLogprobs = tuple[list[int], list[float], list[list[float]], list[list[int]]]


class DecodeBatch:
    """Up to ``max_rows`` sequences of ``model`` decoded together.

    ``vocab`` is the tokenizer's vocabulary: logits past it (padding rows of the embedding) are
    never sampled or scored. ``filler`` pads ragged prompts; any id works since padding is
    neither stored nor attended to, and <|bos|> (which every prompt holds) keeps the seen mask
    exact.
    """

    def __init__(
        self, model: Transformer, max_rows: int, max_length: int, vocab: int, filler: int
    ) -> None:
        weights = model.token_embedding.weight
        self.model = model
        self.device = weights.device
        self.vocab = vocab
        self.filler = filler
        self.cache = KVCache(model.config, max_rows, max_length, self.device, weights.dtype)
        self.members: list[Job] = []  # members[i] decodes in cache row i
        self.inputs = torch.zeros(max_rows, dtype=torch.long, device=self.device)  # next token fed
        self.seen: Tensor | None = None  # [max_rows, vocab] bool, only while a penalty is in use
        # [max_rows, vocab] float: tokens generated, only while a frequency/presence penalty is
        self.counts: Tensor | None = None
        self._sampling: SamplingBatch | None = None
        self._logprob_rows: Tensor | None = None
        self._logprob_top = 0
        self._changed = False

    def __len__(self) -> int:
        return len(self.members)

    @property
    def free(self) -> int:
        return self.cache.rows - len(self.members)

    def decode(self) -> Tensor:
        """One cached step for every row, feeding each its last sampled token → logits [n, V]."""
        n = len(self.members)
        tokens = self.inputs[:n].unsqueeze(1)
        return self.model(tokens, self.cache, rows=slice(0, n), last_only=True)[:, : self.vocab]

    def prefill(self, joining: list[Job]) -> Tensor:
        """Add ``joining`` at the next free rows and run their prompts in one ragged pass.

        Returns logits [k, V] for the position after each prompt.
        """
        start, lengths = len(self.members), [len(job.prompt_ids) for job in joining]
        prompts = torch.full((len(joining), max(lengths)), self.filler, dtype=torch.long)
        for index, job in enumerate(joining):
            prompts[index, : lengths[index]] = torch.tensor(job.prompt_ids)
            job.row = start + index
        ragged = len(set(lengths)) > 1
        rows = slice(start, start + len(joining))
        logits = self.model(
            prompts.to(self.device),
            self.cache,
            rows=rows,
            new_counts=torch.tensor(lengths) if ragged else None,
            last_only=True,
        )
        self.members.extend(joining)
        if self.seen is not None:
            self.seen[rows] = False
            self.seen[rows].scatter_(1, prompts.to(self.device), True)
        if self.counts is not None:
            self.counts[rows] = 0
        self._changed = True
        return logits[:, : self.vocab]

    def sample(self, logits: Tensor) -> Draw:
        """Draw every row's next token from ``logits`` [n, V]; it is fed at the next step.

        A row that cannot be sampled is reported in the draw's ``failures`` (its token becomes
        ``filler``, so the seen mask and the logprobs stay in range) and the caller removes it;
        the other rows' tokens are unaffected.
        """
        if self._changed:
            self._refresh()
        n = len(self.members)
        seen = None if self.seen is None else self.seen[:n]
        assert self._sampling is not None
        counts = None if self.counts is None else self.counts[:n]
        tokens, failures = self._sampling.draw(logits, seen, counts)
        if failures:
            tokens[list(failures)] = self.filler
        if seen is not None:
            seen.scatter_(1, tokens.unsqueeze(1), True)
        if counts is not None:
            counts.scatter_add_(1, tokens.unsqueeze(1), torch.ones_like(counts[:, :1]))
        self.inputs[:n] = tokens
        return Draw(tokens, failures)

    def logprobs(self, logits: Tensor, tokens: Tensor) -> StepLogprobs | None:
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

    def remove(self, leaving: list[Job]) -> None:
        """Drop ``leaving`` and compact: the last row moves into each freed slot."""
        for job in sorted(leaving, key=lambda job: job.row or 0, reverse=True):
            row, last = job.row, len(self.members) - 1
            assert row is not None and self.members[row] is job
            if row != last:
                moved = self.members[last]
                self.cache.move_row(last, row)
                self.inputs[row] = self.inputs[last]
                if self.seen is not None:
                    self.seen[row] = self.seen[last]
                if self.counts is not None:
                    self.counts[row] = self.counts[last]
                self.members[row], moved.row = moved, row
            self.members.pop()
            self.cache.reset(last)
            job.row = None
        self._changed = True

    def clear(self) -> list[Job]:
        """Forget every row (after a failed step); returns the jobs that were decoding."""
        jobs, self.members = self.members, []
        self.cache.lengths.zero_()
        for job in jobs:
            job.row = None
        self.seen, self.counts, self._changed = None, None, True
        return jobs

    def _refresh(self) -> None:
        """Rebuild what depends on membership: sampling tensors, logprob rows, seen mask."""
        self._changed = False
        if not self.members:
            self._sampling, self._logprob_rows, self.seen, self.counts = None, None, None, None
            return
        self._sampling = SamplingBatch([job.sampler for job in self.members], self.device)
        wanted = [job.row for job in self.members if job.logprobs is not None]
        self._logprob_rows = torch.tensor(wanted, device=self.device) if wanted else None
        self._logprob_top = max((job.logprobs or 0 for job in self.members), default=0)
        if not self._sampling.uses_penalty:
            self.seen = None
        elif self.seen is None:
            self.seen = self._seen_from_tokens()
        if not self._sampling.uses_counts:
            self.counts = None
        elif self.counts is None:
            self.counts = self._counts_from_tokens()

    def _counts_from_tokens(self) -> Tensor:
        """The generated-token counts rebuilt from every row's generated tokens."""
        counts = torch.zeros(self.cache.rows, self.vocab, device=self.device)
        for job in self.members:
            assert job.row is not None and job.state is not None
            generated = torch.tensor(job.state.generated_ids, dtype=torch.long, device=self.device)
            counts[job.row].scatter_add_(
                0, generated, torch.ones_like(generated, dtype=counts.dtype)
            )
        return counts

    def _seen_from_tokens(self) -> Tensor:
        """The seen mask rebuilt from every row's prompt and generated tokens."""
        seen = torch.zeros(self.cache.rows, self.vocab, dtype=torch.bool, device=self.device)
        for job in self.members:
            assert job.row is not None and job.state is not None
            ids = torch.tensor([*job.prompt_ids, *job.state.generated_ids], device=self.device)
            seen[job.row, ids] = True
        return seen
