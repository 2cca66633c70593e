"""Turning next-token logits into tokens: the one place that applies sampling.

Both offline ``generate()`` and the server's continuous-batching engine call this module on a
batch whose rows each carry their own :class:`SamplingParams`. Filters apply in this order:

-1. **Grammar** (structured outputs): a row with a :class:`TokenConstraint` (its
   ``SamplingParams.grammar``, matched by ``model.grammar``) gets −inf for every token its
   grammar does not allow next, so each filter below sees only allowed tokens; after the draw
   its matcher advances by the token drawn. Rows without one pay nothing: no mask is built
   for them.
0. **Logit bias** (OpenAI's ``logit_bias``): a fixed amount added to chosen tokens' logits.
1. **Repetition penalty** on the logits of tokens the row has already seen (prompt and
   generated), CTRL rule: a positive logit is divided by the penalty, a negative one multiplied.
   Then OpenAI's **frequency and presence penalties** on the tokens the row has generated:
   ``logit -= frequency_penalty × count + presence_penalty × (count > 0)``.
2. **Temperature**: logits are divided by it. A temperature below ``MIN_TEMPERATURE`` (1e-5,
   vLLM's rule) means greedy (argmax of the penalised logits); the filters below then change
   nothing. Dividing by a smaller one would overflow float32 into inf, and softmax into NaN.
3. **Top-k**: keep the k most probable tokens (0 = off).
4. **Top-p** (nucleus): keep the smallest set of most probable tokens whose mass reaches p,
   i.e. keep token i while the mass strictly before it is below p. The top token always stays.
5. **Min-p**: keep tokens whose probability is at least min_p times the top probability.
6. **Renormalise and draw** by inverse CDF with one uniform from the row's own generator.

Each filter sees the distribution renormalised after the previous one. Every row owns a CPU
``torch.Generator`` (see :class:`RowSampler`), so a seeded request yields the same tokens alone
or inside any batch, on any device.

A row fails alone: :meth:`SamplingBatch.draw` reports rows whose logits are not finite or whose
draw raised, and the other rows' tokens are exactly what they would have been without them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache, cached_property, partial
from typing import NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor

from model.kernels import argmax as argmax_kernel
from model.kernels import draw as draw_kernel
from model.sampling_params import MIN_TEMPERATURE, FailureReason, SamplingParams

_DEFAULTS = SamplingParams()  # the value of each column a request leaves out

# Float32 cumulative sums are off by about this much; mass within it of p counts as reaching p,
# so that e.g. p = 0.85 over probabilities [0.5, 0.2, 0.15, ...] keeps exactly three tokens.
_MASS_TOLERANCE = 1e-6

logger = logging.getLogger("ordinal.sampling")

_NO_UNIFORM = 0.0  # the stand-in uniform of a row whose generator failed
# A row draws its uniforms this many at a time: one torch call per row every 64 steps instead of
# every step (32 of batch 32's ops per step). torch.rand(n) gives exactly the numbers of n calls
# of torch.rand(1) on a CPU generator (tests/model/test_sampling.py holds it to that), so a
# seeded row's tokens are those of drawing one per step.
UNIFORM_BLOCK = 64


class Draw(NamedTuple):
    """One step's draw: a token per row, and the rows that failed (their token is meaningless)."""

    tokens: Tensor  # [B] long
    failures: dict[int, FailureReason]


@dataclass(frozen=True)
class SamplingMetadata:
    """Every row's stateless sampling parameters, one [B] column each, on the logits' device:
    the one object the filters read (vLLM's ``SamplingMetadata``). A column is named after its
    :class:`SamplingParams` field and takes that field's values (long for an int field, else
    float32); a new stateless parameter is a field there, a column here and its filter."""

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    min_p: Tensor
    repetition_penalty: Tensor
    frequency_penalty: Tensor
    presence_penalty: Tensor

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: torch.device | str) -> SamplingMetadata:
        """The columns of ``params``, row i from ``params[i]``."""
        return cls.filled(
            len(params),
            device,
            **{name: [getattr(p, name) for p in params] for name in cls.names()},
        )

    @classmethod
    def filled(
        cls, batch: int, device: torch.device | str, **given: Tensor | Sequence[float]
    ) -> SamplingMetadata:
        """``batch`` rows with the ``given`` columns and every other column at its default."""

        def column(name: str) -> Tensor:
            default = getattr(_DEFAULTS, name)
            dtype = torch.long if isinstance(default, int) else torch.float32
            values = given.get(name, [default] * batch)
            return torch.as_tensor(values, dtype=dtype, device=device)

        return cls(**{name: column(name) for name in cls.names()})

    @classmethod
    @cache
    def names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))

    def rows(self, index: Tensor | None) -> SamplingMetadata:
        """The columns of the rows at ``index`` [b] (None: every row)."""
        if index is None:
            return self
        return SamplingMetadata(**{name: getattr(self, name)[index] for name in self.names()})


class TokenConstraint(Protocol):
    """Which tokens a row may draw next (``model.grammar.GrammarMatcher`` is one). Each method
    raises (any exception) when the constraint has failed: the row then fails alone, with
    ``FailureReason.GRAMMAR_FAILED`` and the exception's words as its ``RowSampler.failure``."""

    def allowed(self) -> bytes:
        """Bit t of the little-endian bitmask set: token t may come next."""
        ...

    def advance(self, token: int) -> None:
        """The row drew ``token``."""
        ...

    @property
    def complete(self) -> bool:
        """Nothing more may follow: the sequence ends here."""
        ...


class RowSampler:
    """One sequence's sampling state: its parameters, its own CPU random generator and, for a
    row whose output keeps to a grammar, its ``constraint``.

    Create it once per request and keep it while the request decodes, across batch rebuilds.
    """

    def __init__(self, params: SamplingParams, constraint: TokenConstraint | None = None) -> None:
        if params.grammar is not None and constraint is None:
            raise ValueError("params.grammar needs its constraint (a model.grammar matcher)")
        self.params = params
        self.constraint = constraint
        self.failure: str | None = None  # why its constraint failed, once it has
        self.generator = torch.Generator(device="cpu")
        if params.seed is None:
            self.generator.seed()  # a fresh nondeterministic seed, leaving global RNG alone
        else:
            self.generator.manual_seed(params.seed)
        self._unused_uniforms: list[float] = []  # drawn, not yet used: the next one last

    @property
    def complete(self) -> bool:
        """The row's grammar allows nothing more (always False without one)."""
        return self.constraint is not None and self.constraint.complete

    def next_uniform(self) -> float:
        """The row's next uniform in [0, 1) from its own generator (a float32 value), taken from
        a block of ``UNIFORM_BLOCK`` drawn at once."""
        if not self._unused_uniforms:
            block = torch.rand(UNIFORM_BLOCK, generator=self.generator).tolist()
            self._unused_uniforms = block[::-1]  # pop() takes the first drawn
        return self._unused_uniforms.pop()

    @cached_property
    def reads_history(self) -> bool:
        """Whether the row's next distribution depends on its tokens so far (a penalty on them,
        a grammar's state) and not on its logits alone."""
        return bool(self.params.set_fields() & HISTORY_ADJUSTMENTS)

    @cached_property
    def bias(self) -> tuple[Tensor, Tensor]:
        """The row's logit bias as (token ids [K] long, biases [K] float32), CPU: made once per
        request, so a batch's table is a few tensor ops at each batch change."""
        pairs = self.params.logit_bias
        ids = torch.tensor([token for token, _ in pairs], dtype=torch.long)
        return ids, torch.tensor([bias for _, bias in pairs], dtype=torch.float32)


def raise_if_failed(failures: Mapping[int, FailureReason]) -> None:
    """Offline, a row that cannot be sampled is the caller's error (the server fails that row
    alone instead): a ValueError naming the first such row and why."""
    if failures:
        row, reason = next(iter(failures.items()))
        raise ValueError(f"row {row} of the batch could not be sampled: {reason}")


class SamplingBatch:
    """The per-row parameters of the rows now decoding, as [B] tensors on ``device``.

    Build a new one whenever rows join or leave the batch (cheap: a few small tensors); reuse
    it for every decode step in between. Row i of the logits belongs to ``rows[i]``.

    Each row draws along the cheapest path that gives its exact distribution: greedy rows take
    the argmax; rows with a temperature alone draw from its softmax; rows with min-p but no
    top-k or top-p draw in vocabulary order (no sort); only rows with top-k or top-p sort the
    vocabulary. The path depends on the row's own parameters alone, so a seeded row draws the
    same tokens whatever rows share its batch.
    """

    def __init__(self, rows: Sequence[RowSampler], device: torch.device | str = "cpu") -> None:
        if not rows:
            raise ValueError("rows must hold at least one RowSampler")
        self.rows = tuple(rows)
        params = [row.params for row in self.rows]
        self.metadata = SamplingMetadata.of(params, device)
        self.all_greedy = all(p.greedy for p in params)
        self.uses_penalty = any(p.repetition_penalty != 1.0 for p in params)
        self.uses_counts = any(p.frequency_penalty or p.presence_penalty for p in params)
        self._bias: Tensor | None = None  # [B, V], built at the first draw that needs it
        self.uses_bias = any(p.logit_bias for p in params)
        self._constrained = [  # (row, its constraint) for the rows that have one
            (i, row.constraint) for i, row in enumerate(self.rows) if row.constraint is not None
        ]
        paths = [_path(p) for p in params]
        # Every row tempered and nothing set (no filter, no adjustment): the draw kernel checks
        # the logits itself.
        self._tempered_only = set(paths) == {"temperature only"} and not any(
            p.set_fields() for p in params
        )
        self._groups = [
            self._group([i for i, path in enumerate(paths) if path == kind], kind, device)
            for kind in _PATHS
            if kind in paths
        ]

    def _group(self, indices: list[int], kind: str, device: torch.device | str) -> _RowGroup:
        everyone = len(indices) == len(self.rows)
        index = None if everyone else torch.tensor(indices, device=device)
        if kind == "greedy":
            return _RowGroup(index, _draw_greedy)
        draw = {
            "temperature only": _draw_tempered,
            "vocabulary order": _draw_unsorted,
            "sorted": _draw_sorted,
        }[kind]
        return _RowGroup(index, partial(draw, self.metadata.rows(index)))

    def sample(
        self, logits: Tensor, seen: Tensor | None = None, counts: Tensor | None = None
    ) -> Tensor:
        """Draw the next token of every row; raise ValueError if any row cannot be sampled.

        logits: [B, V] any float dtype, on ``device``. seen: [B, V] bool, True where the row's
        prompt or output already holds the token, or None (nothing seen). counts: [B, V] float,
        how often the row has generated each token (for frequency/presence penalties), or None.
        Returns [B] long.
        """
        tokens, failures = self.draw(logits, seen, counts)
        raise_if_failed(failures)
        return tokens

    def draw(
        self, logits: Tensor, seen: Tensor | None = None, counts: Tensor | None = None
    ) -> Draw:
        """Like :meth:`sample`, but a row that fails fails alone: it is reported in
        ``failures`` and every other row gets the token it would have drawn without it."""
        batch = len(self.rows)
        if logits.dim() != 2 or logits.shape[0] != batch:
            raise ValueError(f"logits must have shape [{batch}, V], got {tuple(logits.shape)}")
        if seen is not None:
            _check_seen(seen, logits)
        logits = logits.float()
        failures: dict[int, FailureReason] = {}
        uniforms: Tensor | None = None
        if self._tempered_only and draw_kernel.applies(logits):
            # The common sampled step in one call: the kernel's own checks replace the finite
            # sum and the range test below. Anything amiss, and the step takes the general way
            # with the same uniforms, so a row's failure and its neighbours' tokens are the same.
            uniforms = self._uniforms(failures, logits.device)
            if not failures and uniforms is not None:
                tokens, failed = draw_kernel.tempered_raw(
                    logits, self.metadata.temperature, uniforms
                )
                if not failed:
                    return Draw(tokens, failures)
        return self._checked_draw(logits, seen, counts, uniforms, failures)

    def _checked_draw(
        self,
        logits: Tensor,
        seen: Tensor | None,
        counts: Tensor | None,
        uniforms: Tensor | None,
        failures: dict[int, FailureReason],
    ) -> Draw:
        """:meth:`draw` every way: logits [B, V] float32; ``uniforms`` [B] when already drawn
        (with their ``failures``), else None."""
        batch, vocab = len(self.rows), logits.shape[-1]
        # A row's sum is finite exactly when its logits are (NaN and ±inf propagate; finite
        # logits would need |x| ~ 1e34 to overflow it): one reduction, not isfinite over [B, V],
        # which costs 270 µs at [32, 2048] on this CPU against 17 µs for the sum. The whole
        # batch's sum clears the common case with one reduction and one read (2 µs, against 7
        # for the rows' sums and their test); only when it is not finite are the rows checked.
        if not math.isfinite(float(logits.sum())):
            finite = torch.isfinite(logits.sum(dim=-1))
            for row in (~finite).nonzero().flatten().tolist():
                failures[row] = FailureReason.NON_FINITE_LOGITS
            logits = logits.masked_fill(~finite.unsqueeze(-1), 0.0)  # any finite row will do
        if self._constrained:
            logits = self._constrain(logits, failures)
        if uniforms is None:
            uniforms = self._uniforms(failures, logits.device)
        history = _History(seen, counts)
        try:
            tokens = self._draw(logits, history, uniforms)
        except Exception:  # find the rows at fault: each draws alone, with its own uniform
            logger.exception("the batch's draw raised: drawing its %d rows one by one", batch)
            tokens = self._draw_each(logits, history, uniforms, failures)
        # Tokens drawn along a sampling path are checked; an all-greedy draw is argmaxes, in
        # range by construction, and skips the check's op and two reads back on every step.
        if uniforms is not None and _outside(tokens, vocab):
            outside = (tokens < 0) | (tokens >= vocab)
            for row in outside.nonzero().flatten().tolist():
                failures.setdefault(row, FailureReason.SAMPLING_ERROR)
        if self._constrained:
            self._advance(tokens, failures)
        return Draw(tokens, failures)

    def _constrain(self, logits: Tensor, failures: dict[int, FailureReason]) -> Tensor:
        """Step -1: ``logits`` [B, V] with −inf where a constrained row's grammar forbids the
        token (a new tensor: the caller's raw logits stay for the logprobs). A row whose
        constraint fails is reported and left unmasked (its token is discarded).

        The masks are unpacked in numpy (~1 µs, where each torch op costs ~10 µs on this CPU)
        and written in place into one copy, row by row."""
        masked, masks = [], []
        for index, constraint in self._constrained:
            try:
                masks.append(constraint.allowed())
                masked.append(index)
            except Exception as error:  # the constraint's own failure: its row's alone
                self._constraint_failed(index, error, failures)
        if not masked:
            return logits
        vocab = logits.shape[-1]
        packed = np.frombuffer(b"".join(masks), dtype=np.uint8).reshape(len(masked), -1)
        # [c, V]; tokens past the grammar's vocabulary are unpacked as 0: forbidden too
        allowed = np.unpackbits(packed, axis=1, count=vocab, bitorder="little").view(np.bool_)
        forbidden = torch.from_numpy(~allowed).to(logits.device)
        constrained = logits.clone()
        for row, index in enumerate(masked):
            constrained[index].masked_fill_(forbidden[row], -math.inf)
        return constrained

    def _advance(self, tokens: Tensor, failures: dict[int, FailureReason]) -> None:
        """Each constrained row's matcher takes its token; one that refuses fails its row."""
        drawn = tokens.tolist()
        for index, constraint in self._constrained:
            token = drawn[index]
            if index in failures:
                continue
            try:
                constraint.advance(token)
            except Exception as error:  # the constraint's own failure: its row's alone
                self._constraint_failed(index, error, failures)

    def _constraint_failed(
        self, index: int, error: Exception, failures: dict[int, FailureReason]
    ) -> None:
        """Row ``index`` fails: its constraint raised ``error``."""
        logger.warning("row %d: its grammar failed: %s", index, error, exc_info=error)
        failures[index] = FailureReason.GRAMMAR_FAILED
        self.rows[index].failure = str(error)

    def _uniforms(self, failures: dict[int, FailureReason], device: torch.device) -> Tensor | None:
        """One uniform per row per step, whichever path it draws along (None: all greedy)."""
        if self.all_greedy:
            return None
        drawn: list[float] = []  # one per row, made a tensor once
        for index, row in enumerate(self.rows):
            try:
                drawn.append(row.next_uniform())
            except Exception:
                logger.exception("row %d: its generator raised", index)
                failures[index] = FailureReason.SAMPLING_ERROR
                drawn.append(_NO_UNIFORM)
        # through numpy: torch.tensor(list) issues four torch ops, from_numpy none
        return torch.from_numpy(np.asarray(drawn, dtype=np.float32)).to(device)

    def _draw(self, logits: Tensor, history: _History, uniforms: Tensor | None) -> Tensor:
        """Every row's token: bias and penalties, then each row group along its path."""
        logits = self.adjust(logits, history)
        if uniforms is None:  # every row greedy
            return _draw_greedy(logits, None)
        if self._groups[0].index is None:  # one path for the whole batch
            return self._groups[0].draw(logits, uniforms)
        tokens = torch.empty(len(self.rows), dtype=torch.long, device=logits.device)
        for group in self._groups:
            tokens[group.index] = group.draw(logits[group.index], uniforms[group.index])
        return tokens

    def adjust(self, logits: Tensor, history: _History) -> Tensor:
        """Steps 0-1 of the module docstring: logit bias, then the penalties. [B, V] float32."""
        if self.uses_bias:
            logits = logits + self._bias_table(logits)
        meta = self.metadata
        if history.seen is not None and self.uses_penalty:
            logits = apply_repetition_penalty(logits, history.seen, meta.repetition_penalty)
        if history.counts is not None and self.uses_counts:
            logits = apply_frequency_presence_penalties(
                logits, history.counts, meta.frequency_penalty, meta.presence_penalty
            )
        return logits

    def _bias_table(self, logits: Tensor) -> Tensor:
        """Each row's logit bias as a dense [B, V] float32 (ids past V are ignored)."""
        vocab = logits.shape[-1]
        if self._bias is None or self._bias.shape[-1] != vocab:
            table = torch.zeros(len(self.rows), vocab)
            biased = [(row, s.bias) for row, s in enumerate(self.rows) if s.params.logit_bias]
            if biased:
                ids = torch.cat([ids for _, (ids, _) in biased])
                values = torch.cat([values for _, (_, values) in biased])
                rows = torch.cat([torch.full_like(ids, row) for row, (ids, _) in biased])
                inside = ids < vocab
                table[rows[inside], ids[inside]] = values[inside]
            self._bias = table.to(logits.device)
        return self._bias

    def _draw_each(
        self,
        logits: Tensor,
        history: _History,
        uniforms: Tensor | None,
        failures: dict[int, FailureReason],
    ) -> Tensor:
        """The slow path after a batched draw raised: row by row, recording the failures."""
        tokens = torch.zeros(len(self.rows), dtype=torch.long, device=logits.device)
        for index, row in enumerate(self.rows):
            if index in failures:
                continue
            alone = slice(index, index + 1)
            try:
                tokens[alone] = SamplingBatch([row], logits.device)._draw(
                    logits[alone],
                    history.row(alone),
                    None if uniforms is None or row.params.greedy else uniforms[alone],
                )
            except Exception:
                logger.exception("row %d could not be sampled", index)
                failures[index] = FailureReason.SAMPLING_ERROR
        return tokens


# What each path applies to the logits, in the order rows try them; every path also takes the
# adjustments (ADJUSTMENTS: applied to every row's logits before its path draws). A row takes
# the first path that applies every field it sets (SamplingParams.set_fields).
_PATHS: dict[str, frozenset[str]] = {
    "greedy": frozenset(),
    "temperature only": frozenset(),
    "vocabulary order": frozenset({"min_p"}),
    "sorted": frozenset({"top_k", "top_p", "min_p"}),
}
# The adjustments that read the row's history (its tokens so far, its grammar's state): a row
# setting none of them draws from its logits alone (model.speculative relies on it).
HISTORY_ADJUSTMENTS = frozenset(
    {"repetition_penalty", "frequency_penalty", "presence_penalty", "grammar"}
)
ADJUSTMENTS = HISTORY_ADJUSTMENTS | {"logit_bias"}


def _path(params: SamplingParams) -> str:
    """The cheapest path that applies every field ``params`` sets; ValueError if none does (a
    field in NEUTRAL that no path has learned: never drawn past)."""
    filters = params.set_fields() - ADJUSTMENTS
    if params.greedy:
        return "greedy"  # filters keep the largest logit: greedy draws it with any of them
    for path, applies in _PATHS.items():
        if path != "greedy" and filters <= applies:
            return path
    raise ValueError(f"no sampling path applies {', '.join(sorted(filters))}")


@dataclass(frozen=True)
class _RowGroup:
    """The rows of a batch that draw along one path (``index`` None: every row)."""

    index: Tensor | None
    draw: Callable[[Tensor, Tensor | None], Tensor]  # (logits [b, V], uniforms [b]) → [b]


def _outside(tokens: Tensor, vocab: int) -> bool:
    """Whether any of ``tokens`` [B] is outside 0..vocab-1."""
    lowest, highest = torch.aminmax(tokens)  # one op where a range test takes three
    return int(lowest) < 0 or int(highest) >= vocab


def _draw_greedy(logits: Tensor, uniforms: Tensor | None) -> Tensor:
    if argmax_kernel.applies(logits):  # torch's argmax: ~10x slower (model/kernels/argmax.py)
        return argmax_kernel.argmax(logits)
    return logits.argmax(dim=-1)


def _draw_tempered(meta: SamplingMetadata, logits: Tensor, uniforms: Tensor | None) -> Tensor:
    """Temperature alone: the softmax drawn from as it is (min-p's five passes over [b, V]
    were ~4% of a 64-stream step; the draw scales by the total, so no renormalising is needed).

    meta: b rows; logits [b, V]; uniforms [b]. Returns [b] long.
    """
    assert uniforms is not None
    if draw_kernel.applies(logits):  # the same draw in one pass a row (model/kernels/draw.py)
        return draw_kernel.tempered(logits, meta.temperature, uniforms)
    return _draw_inverse_cdf(_unsorted_stages(logits, meta, min_p=False)[-1].probs, None, uniforms)


def _draw_unsorted(meta: SamplingMetadata, logits: Tensor, uniforms: Tensor | None) -> Tensor:
    """Temperature and min-p only: both keep the distribution's order, so no sort is needed.

    meta: b rows; logits [b, V]; uniforms [b]. Returns [b] long.
    """
    assert uniforms is not None
    probs = _unsorted_stages(logits, meta)[-1].probs
    return _draw_inverse_cdf(probs, None, uniforms)


def _draw_sorted(meta: SamplingMetadata, logits: Tensor, uniforms: Tensor | None) -> Tensor:
    """Any filters, in the sorted order top-k and top-p need. Shapes as in _draw_unsorted."""
    assert uniforms is not None
    stages, sorted_ids = _sorted_stages(logits, meta)
    return _draw_inverse_cdf(stages[-1].probs, sorted_ids, uniforms)


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: Tensor) -> Tensor:
    """CTRL repetition penalty. logits [B, V], seen [B, V] bool, penalty [B] → [B, V] float32.

    Seen tokens: positive logits are divided by the penalty, the others multiplied by it.
    """
    _check_seen(seen, logits)
    logits = logits.float()
    penalty = penalty.unsqueeze(-1)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


@dataclass(frozen=True)
class _History:
    """What a batch's rows have seen (prompt and output, [B, V] bool) and generated (counts,
    [B, V] float); either None where no row's settings need it."""

    seen: Tensor | None
    counts: Tensor | None

    def row(self, rows: slice) -> _History:
        return _History(
            None if self.seen is None else self.seen[rows],
            None if self.counts is None else self.counts[rows],
        )


def apply_frequency_presence_penalties(
    logits: Tensor, counts: Tensor, frequency: Tensor, presence: Tensor
) -> Tensor:
    """OpenAI's penalties. logits, counts [B, V] (counts: times each token was generated);
    frequency, presence [B]. Returns [B, V] float32: logit − f·count − p·(count > 0)."""
    if counts.shape != logits.shape:
        raise ValueError(f"counts must have shape {tuple(logits.shape)}, got {tuple(counts.shape)}")
    counts = counts.float()
    return (
        logits.float()
        - frequency.unsqueeze(-1) * counts
        - presence.unsqueeze(-1) * (counts > 0).float()
    )


def _check_seen(seen: Tensor, logits: Tensor) -> None:
    if seen.shape != logits.shape or seen.dtype != torch.bool:
        raise ValueError(
            f"seen must be a bool tensor of shape {tuple(logits.shape)}, "
            f"got {seen.dtype} {tuple(seen.shape)}"
        )


def token_logprobs(logits: Tensor, tokens: Tensor, top_n: int) -> tuple[Tensor, Tensor, Tensor]:
    """Log-probabilities under the raw model distribution (no penalty, temperature or filters).

    logits [B, V], tokens [B] long. Returns (chosen [B], top_values [B, top_n] descending,
    top_ids [B, top_n]), all float32 except the ids.
    """
    vocab = logits.shape[-1]
    if not 0 <= top_n <= vocab:
        raise ValueError(f"top_n must be in [0, {vocab}], got {top_n}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    top_values, top_ids = logprobs.topk(top_n, dim=-1)
    return chosen, top_values, top_ids


class Stage(NamedTuple):
    """The distribution after one sampling stage: ``probs`` [B, V] (or [V] for one row)."""

    name: str  # logits, repetition_penalty, temperature, top_k, top_p or min_p
    probs: Tensor


def _sorted_stages(logits: Tensor, meta: SamplingMetadata) -> tuple[list[Stage], Tensor]:
    """Steps 2-5 of the module docstring in sorted order, keeping the result of each step.

    logits [B, V]; meta: B rows. Returns the stages temperature, top_k, top_p, min_p (each
    probs [B, V] float32, sorted descending, rows summing to 1) and the token id of each sorted
    column [B, V] long. The sampler draws from the last stage. Every filter keeps a prefix of
    the sorted order, which is why sorting once is enough.
    """
    temperature = meta.temperature
    greedy = temperature < MIN_TEMPERATURE
    safe_temperature = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits.float() / safe_temperature.unsqueeze(-1)
    # Stable sort puts the lowest id first among ties, matching argmax.
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logits.softmax(dim=-1)
    rank = torch.arange(probs.shape[-1], device=probs.device)
    # Greedy keeps only the first sorted token, the argmax: one-hot from this stage on.
    probs = torch.where(greedy.unsqueeze(-1), (rank == 0).to(probs.dtype), probs)
    stages = [Stage("temperature", probs)]

    # k = 0 (off) keeps the whole vocabulary.
    k = torch.where(meta.top_k > 0, meta.top_k, probs.shape[-1])
    probs = _renormalise(probs * (rank < k.unsqueeze(-1)))
    stages.append(Stage("top_k", probs))

    mass_before = probs.cumsum(dim=-1) - probs
    top_p = meta.top_p.unsqueeze(-1)
    reached = mass_before >= top_p - _MASS_TOLERANCE
    probs = _renormalise(probs * ((rank == 0) | (top_p >= 1) | ~reached))
    stages.append(Stage("top_p", probs))

    stages.append(Stage("min_p", _min_p_filter(probs, meta.min_p)))
    return stages, sorted_ids


def _unsorted_stages(logits: Tensor, meta: SamplingMetadata, min_p: bool = True) -> list[Stage]:
    """Temperature then (``min_p``) min-p in vocabulary order (both keep the order, so no sort
    is needed).

    logits [B, V]; meta: B rows, every temperature ≥ MIN_TEMPERATURE. Returns the stages
    temperature and min_p, each probs [B, V] float32 in vocabulary order.
    """
    probs = (logits / meta.temperature.unsqueeze(-1)).softmax(dim=-1)
    if not min_p:
        return [Stage("temperature", probs)]
    return [Stage("temperature", probs), Stage("min_p", _min_p_filter(probs, meta.min_p))]


def _min_p_filter(probs: Tensor, min_p: Tensor) -> Tensor:
    """Keep tokens with at least min_p × the top probability. probs [B, V], min_p [B].

    A ratio to the top probability, so it needs no renormalisation before it; in sorted order
    the top is column 0, in vocabulary order the row's maximum (the same value).
    """
    top = probs.amax(dim=-1, keepdim=True)
    return _renormalise(probs * (probs >= min_p.unsqueeze(-1) * top))


def sampling_stages(
    logits: Tensor,
    params: SamplingParams,
    seen: Tensor | None = None,
    counts: Tensor | None = None,
    constraint: TokenConstraint | None = None,
) -> list[Stage]:
    """One row's next-token distribution after each stage the sampler applies, in its order.

    logits [V] (any float dtype); seen [V] bool (the prompt's and output's tokens) or None.
    Returns stages with probs [V] float32 in vocabulary order, each summing to 1: ``logits``
    (softmax of the raw logits), then ``grammar`` (with a ``constraint``: the row's grammar
    mask; it raises if the constraint fails), ``logit_bias`` (if any), ``repetition_penalty``
    (if not 1 and ``seen`` is given), ``frequency_presence_penalty`` (if set and ``counts``
    is given), ``temperature``, and ``top_k`` / ``top_p`` / ``min_p`` where they are set. The
    last stage is the distribution :class:`SamplingBatch` draws this row from: it runs the same
    steps, along the same path (sorted, or vocabulary order without top-k and top-p).
    """
    logits = logits.float().unsqueeze(0)
    batch = SamplingBatch([RowSampler(params, constraint)], logits.device)
    meta = batch.metadata
    stages = [Stage("logits", logits.softmax(dim=-1))]
    if constraint is not None:
        failures: dict[int, FailureReason] = {}
        logits = batch._constrain(logits, failures)
        if failures:
            constraint.allowed()  # raises the constraint's own error
        stages.append(Stage("grammar", logits.softmax(dim=-1)))
    if params.logit_bias:
        logits = logits + batch._bias_table(logits)
        stages.append(Stage("logit_bias", logits.softmax(dim=-1)))
    if seen is not None and params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen.unsqueeze(0), meta.repetition_penalty)
        stages.append(Stage("repetition_penalty", logits.softmax(dim=-1)))
    if counts is not None and batch.uses_counts:
        logits = apply_frequency_presence_penalties(
            logits, counts.unsqueeze(0), meta.frequency_penalty, meta.presence_penalty
        )
        stages.append(Stage("frequency_presence_penalty", logits.softmax(dim=-1)))
    if _path(params) in ("temperature only", "vocabulary order"):
        filtered = _unsorted_stages(logits, meta, min_p=params.min_p > 0)
    else:  # greedy rows take the argmax, which is the first sorted token
        sorted_stages, ids = _sorted_stages(logits, meta)
        filtered = [
            Stage(stage.name, torch.zeros_like(stage.probs).scatter(-1, ids, stage.probs))
            for stage in sorted_stages
        ]
    applies = {
        "temperature": True,
        "top_k": params.top_k > 0,
        "top_p": params.top_p < 1,
        "min_p": params.min_p > 0,
    }
    stages += [stage for stage in filtered if applies[stage.name]]
    return [Stage(stage.name, stage.probs[0]) for stage in stages]


def _renormalise(probs: Tensor) -> Tensor:
    """Scale each row of [B, V] to sum to 1 (the top token always keeps positive mass)."""
    return probs / probs.sum(dim=-1, keepdim=True)


def _draw_inverse_cdf(probs: Tensor, ids: Tensor | None, uniforms: Tensor) -> Tensor:
    """Pick the token whose cumulative-mass interval holds each uniform.

    probs [B, V] (zero for tokens filtered out); ids [B, V] the token of each column, or None
    when columns are token ids; uniforms [B] in [0, 1). Returns [B] long.
    """
    cdf = probs.cumsum(dim=-1)
    # Scaling by the total rather than trusting it to be 1 means target <= cdf[-1] even after
    # rounding; a target above 0 means the search (the first cdf reaching it) lands on a token
    # with mass, never on a filtered-out one whose cdf merely repeats its predecessor's.
    targets = (uniforms.unsqueeze(-1) * cdf[:, -1:]).clamp(min=torch.finfo(cdf.dtype).tiny)
    position = torch.searchsorted(cdf, targets.contiguous())
    return position.squeeze(-1) if ids is None else ids.gather(-1, position).squeeze(-1)
