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

import math
from collections.abc import Sequence
from dataclasses import dataclass

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
            return logits.argmax(dim=-1)
        sorted_probs, sorted_ids = _sorted_filtered_probs(
            logits, self.temperature, self.top_k, self.top_p, self.min_p
        )
        uniforms = torch.cat([row.next_uniform() for row in self.rows]).to(logits.device)
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


def _draw_inverse_cdf(sorted_probs: Tensor, sorted_ids: Tensor, uniforms: Tensor) -> Tensor:
    """Pick the token whose cumulative-mass interval holds each uniform.

    sorted_probs [B, V] descending, zero past the kept prefix; sorted_ids [B, V]; uniforms [B]
    in [0, 1). Returns [B] long.
    """
    cdf = sorted_probs.cumsum(dim=-1)
    # Scaling by the total rather than trusting it to be 1 means target <= cdf[-1] even after
    # rounding, so the search lands on a kept token: the first whose cdf reaches the target.
    targets = (uniforms.unsqueeze(-1) * cdf[:, -1:]).contiguous()
    position = torch.searchsorted(cdf, targets).squeeze(-1)
    return sorted_ids.gather(-1, position.unsqueeze(-1)).squeeze(-1)
