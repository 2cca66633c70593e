"""Turning next-token logits into tokens: the one place that applies sampling.

Both offline ``generate()`` and the server's continuous-batching engine call this module on a
batch whose rows each carry their own :class:`SamplingParams`. Filters apply in this order:

1. **Repetition penalty** on the raw logits of tokens the row has already seen (prompt and
   generated), CTRL rule: a positive logit is divided by the penalty, a negative one multiplied.
2. **Temperature**: logits are divided by it. Temperature 0 means greedy (argmax of the
   penalised logits); the filters below then change nothing.
3. **Top-k**: keep the k most probable tokens (0 = off).
4. **Top-p** (nucleus): keep the smallest set of most probable tokens whose mass reaches p,
   i.e. keep token i while the mass strictly before it is below p. The top token always stays.
5. **Min-p**: keep tokens whose probability is at least min_p times the top probability.
6. **Renormalise and draw** by inverse CDF with one uniform from the row's own generator.

Each filter sees the distribution renormalised after the previous one. Every row owns a CPU
``torch.Generator`` (see :class:`RowSampler`), so a seeded request yields the same tokens alone
or inside any batch, on any device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

# Float32 cumulative sums are off by about this much; mass within it of p counts as reaching p,
# so that e.g. p = 0.85 over probabilities [0.5, 0.2, 0.15, ...] keeps exactly three tokens.
_MASS_TOLERANCE = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens. Defaults sample from the raw distribution."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int | None = None  # None = nondeterministic

    def __post_init__(self) -> None:
        def require(ok: bool, field: str, valid: str) -> None:
            if not ok:
                raise ValueError(f"{field} must be {valid}, got {getattr(self, field)!r}")

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        require(
            0 <= self.temperature < math.inf, "temperature", "a finite number >= 0 (0 = greedy)"
        )
        require(is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0 (0 = off)")
        require(0 < self.top_p <= 1, "top_p", "in (0, 1] (1 = off)")
        require(0 <= self.min_p <= 1, "min_p", "in [0, 1] (0 = off)")
        require(
            0 < self.repetition_penalty < math.inf,
            "repetition_penalty",
            "a finite number > 0 (1 = off)",
        )
        require(
            self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**64),
            "seed",
            "None or an integer in [0, 2**64)",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class RowSampler:
    """One sequence's sampling state: its parameters and its own CPU random generator.

    Create it once per request and keep it while the request decodes, across batch rebuilds.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator(device="cpu")
        if params.seed is None:
            self.generator.seed()  # a fresh nondeterministic seed, leaving global RNG alone
        else:
            self.generator.manual_seed(params.seed)

    def next_uniform(self) -> Tensor:
        """One uniform draw in [0, 1) from this row's generator. Shape [1], CPU, float32."""
        return torch.rand(1, generator=self.generator)


class SamplingBatch:
    """The per-row parameters of the rows now decoding, as [B] tensors on ``device``.

    Build a new one whenever rows join or leave the batch (cheap: a few small tensors); reuse
    it for every decode step in between. Row i of the logits belongs to ``rows[i]``.

    Each row draws along the cheapest path that gives its exact distribution: greedy rows take
    the argmax; rows without top-k or top-p draw in vocabulary order (no sort); only rows with
    top-k or top-p sort the vocabulary. The path depends on the row's own parameters alone, so a
    seeded row draws the same tokens whatever rows share its batch.
    """

    def __init__(self, rows: Sequence[RowSampler], device: torch.device | str = "cpu") -> None:
        if not rows:
            raise ValueError("rows must hold at least one RowSampler")
        self.rows = tuple(rows)
        params = [row.params for row in self.rows]

        def column(field: str, dtype: torch.dtype) -> Tensor:
            return torch.tensor([getattr(p, field) for p in params], dtype=dtype, device=device)

        self.temperature = column("temperature", torch.float32)
        self.top_k = column("top_k", torch.long)
        self.top_p = column("top_p", torch.float32)
        self.min_p = column("min_p", torch.float32)
        self.repetition_penalty = column("repetition_penalty", torch.float32)
        self.all_greedy = all(p.greedy for p in params)
        self.uses_penalty = any(p.repetition_penalty != 1.0 for p in params)
        paths = [_path(p) for p in params]
        self._groups = [
            self._group([i for i, path in enumerate(paths) if path == kind], kind, device)
            for kind in _PATHS
            if kind in paths
        ]

    def _group(self, indices: list[int], kind: str, device: torch.device | str) -> _RowGroup:
        everyone = len(indices) == len(self.rows)
        index = None if everyone else torch.tensor(indices, device=device)

        def rows_of(column: Tensor) -> Tensor:
            return column if index is None else column[index]

        if kind == "greedy":
            draw = _draw_greedy
        elif kind == "vocabulary order":
            draw = partial(_draw_unsorted, rows_of(self.temperature), rows_of(self.min_p))
        else:
            columns = (self.temperature, self.top_k, self.top_p, self.min_p)
            draw = partial(_draw_sorted, *map(rows_of, columns))
        return _RowGroup(index, draw)

    def sample(self, logits: Tensor, seen: Tensor | None = None) -> Tensor:
        """Draw the next token of every row.

        logits: [B, V] any float dtype, on ``device``. seen: [B, V] bool, True where the row's
        prompt or output already holds the token, or None (nothing seen). Returns [B] long.
        """
        batch = len(self.rows)
        if logits.dim() != 2 or logits.shape[0] != batch:
            raise ValueError(f"logits must have shape [{batch}, V], got {tuple(logits.shape)}")
        logits = logits.float()
        if seen is not None and self.uses_penalty:
            logits = apply_repetition_penalty(logits, seen, self.repetition_penalty)
        if self.all_greedy:
            return _draw_greedy(logits, None)
        # Every row takes one uniform per step, whichever path it draws along.
        uniforms = torch.cat([row.next_uniform() for row in self.rows]).to(logits.device)
        if self._groups[0].index is None:  # one path for the whole batch
            return self._groups[0].draw(logits, uniforms)
        tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
        for group in self._groups:
            tokens[group.index] = group.draw(logits[group.index], uniforms[group.index])
        return tokens


_PATHS = ("greedy", "vocabulary order", "sorted")


def _path(params: SamplingParams) -> str:
    if params.greedy:
        return "greedy"
    if params.top_k == 0 and params.top_p == 1:
        return "vocabulary order"
    return "sorted"


@dataclass(frozen=True)
class _RowGroup:
    """The rows of a batch that draw along one path (``index`` None: every row)."""

    index: Tensor | None
    draw: Callable[[Tensor, Tensor | None], Tensor]  # (logits [b, V], uniforms [b]) → [b]


def _draw_greedy(logits: Tensor, uniforms: Tensor | None) -> Tensor:
    return logits.argmax(dim=-1)


def _draw_unsorted(
    temperature: Tensor, min_p: Tensor, logits: Tensor, uniforms: Tensor | None
) -> Tensor:
    """Temperature and min-p only: both keep the distribution's order, so no sort is needed.

    temperature, min_p [b]; logits [b, V]; uniforms [b]. Returns [b] long.
    """
    assert uniforms is not None
    probs = (logits / temperature.unsqueeze(-1)).softmax(dim=-1)
    probs = probs * (probs >= min_p.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True))
    return _draw_inverse_cdf(probs, None, uniforms)


def _draw_sorted(
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    logits: Tensor,
    uniforms: Tensor | None,
) -> Tensor:
    """Any filters, in the sorted order top-k and top-p need. Shapes as in _draw_unsorted."""
    assert uniforms is not None
    sorted_probs, sorted_ids = _sorted_filtered_probs(logits, temperature, top_k, top_p, min_p)
    return _draw_inverse_cdf(sorted_probs, sorted_ids, uniforms)


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: Tensor) -> Tensor:
    """CTRL repetition penalty. logits [B, V], seen [B, V] bool, penalty [B] → [B, V] float32.

    Seen tokens: positive logits are divided by the penalty, the others multiplied by it.
    """
    if seen.shape != logits.shape or seen.dtype != torch.bool:
        raise ValueError(
            f"seen must be a bool tensor of shape {tuple(logits.shape)}, "
            f"got {seen.dtype} {tuple(seen.shape)}"
        )
    logits = logits.float()
    penalty = penalty.unsqueeze(-1)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def filtered_probs(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor
) -> Tensor:
    """The distribution each row samples from, after steps 2-5 of the module docstring.

    logits [B, V]; temperature, top_p, min_p [B] float; top_k [B] long. Returns [B, V] float32
    in vocabulary order, each row summing to 1 (one-hot at the argmax where temperature is 0).
    """
    sorted_probs, sorted_ids = _sorted_filtered_probs(logits, temperature, top_k, top_p, min_p)
    return torch.zeros_like(sorted_probs).scatter(-1, sorted_ids, sorted_probs)


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


def _sorted_filtered_probs(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor
) -> tuple[Tensor, Tensor]:
    """Filtered, renormalised probabilities sorted descending, with their token ids.

    Shapes as in :func:`filtered_probs`; returns (probs [B, V] float32, ids [B, V] long).
    Every filter keeps a prefix of the sorted order, which is why sorting once is enough.
    """
    greedy = temperature == 0
    safe_temperature = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits.float() / safe_temperature.unsqueeze(-1)
    # Stable sort puts the lowest id first among ties, matching argmax.
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logits.softmax(dim=-1)
    rank = torch.arange(probs.shape[-1], device=probs.device)

    # Greedy is top-k with k = 1; k = 0 (off) keeps the whole vocabulary.
    k = torch.where(top_k > 0, top_k, probs.shape[-1])
    k = torch.where(greedy, torch.ones_like(k), k)
    probs = _renormalise(probs * (rank < k.unsqueeze(-1)))

    mass_before = probs.cumsum(dim=-1) - probs
    top_p = top_p.unsqueeze(-1)
    reached = mass_before >= top_p - _MASS_TOLERANCE
    probs = _renormalise(probs * ((rank == 0) | (top_p >= 1) | ~reached))

    # A ratio to the top probability, so it needs no renormalisation before it.
    probs = _renormalise(probs * (probs >= min_p.unsqueeze(-1) * probs[:, :1]))
    return probs, sorted_ids


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
