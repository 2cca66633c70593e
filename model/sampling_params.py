"""What a request asks of the sampler, checked: :class:`SamplingParams`, its bounds, and why a
row can fail (:class:`FailureReason`). No torch: the API process checks requests with it and
sends it to the engine, which samples with ``model.sampling``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

# Below this a temperature is greedy (vLLM's _SAMPLING_EPS): logits / 1e-5 stay finite in
# float32 for any logit under 3e33, and the argmax is what such a temperature converges to.
MIN_TEMPERATURE = 1e-5
# The CTRL penalty divides or multiplies logits by this; outside [0.01, 100] a float32 logit
# can reach inf (and 0 × inf = NaN): no useful penalty lies there.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_OPENAI_PENALTY = 2.0  # frequency and presence penalties lie in [-2, 2], as OpenAI's
MAX_TOP_K = 2**63 - 1  # int64; callers cap top_k at their vocabulary first


class FailureReason(StrEnum):
    """Why one row of a batch could not be sampled (the metrics' ``reason`` label)."""

    NON_FINITE_LOGITS = "non_finite_logits"
    SAMPLING_ERROR = "sampling_error"
    GRAMMAR_FAILED = "grammar_failed"  # its constraint failed (RowSampler.failure says why)


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens. Defaults sample from the raw distribution."""

    temperature: float = 1.0  # below MIN_TEMPERATURE (0 included) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]: 0 = off
    presence_penalty: float = 0.0  # OpenAI's, in [-2, 2]: 0 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit in [-100, 100])
    seed: int | None = None  # None = nondeterministic
    # llguidance's grammar text (model.grammar.grammar_of) the output keeps to; None = free
    grammar: str | None = None

    def __post_init__(self) -> None:
        def require(ok: bool, field: str, valid: str) -> None:
            if not ok:
                raise ValueError(f"{field} must be {valid}, got {getattr(self, field)!r}")

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        require(
            0 <= self.temperature < math.inf,
            "temperature",
            f"a finite number >= 0 (below {MIN_TEMPERATURE} = greedy)",
        )
        require(
            is_int(self.top_k) and 0 <= self.top_k <= MAX_TOP_K,
            "top_k",
            "an integer in [0, 2**63) (0 = off)",
        )
        require(0 < self.top_p <= 1, "top_p", "in (0, 1] (1 = off)")
        require(0 <= self.min_p <= 1, "min_p", "in [0, 1] (0 = off)")
        require(
            MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
            "repetition_penalty",
            f"in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}] (1 = off)",
        )
        for field in ("frequency_penalty", "presence_penalty"):
            require(
                -MAX_OPENAI_PENALTY <= getattr(self, field) <= MAX_OPENAI_PENALTY,
                field,
                "in [-2, 2]",
            )
        require(
            all(
                is_int(token) and token >= 0 and -100 <= bias <= 100
                for token, bias in self.logit_bias
            ),
            "logit_bias",
            "pairs of a token id >= 0 and a bias in [-100, 100]",
        )
        require(
            self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**64),
            "seed",
            "None or an integer in [0, 2**64)",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def set_fields(self) -> frozenset[str]:
        """The fields that change what this row draws from: those not at their NEUTRAL value."""
        return frozenset(name for name, off in NEUTRAL.items() if getattr(self, name) != off)


# Every field that changes the distribution a row draws from, at the value that leaves it as
# it is. The sampler's paths (model.sampling) each name the fields they apply, and a row takes
# the first path that applies every one it sets: so a field added here and to no path cannot be
# drawn past (the sampler refuses it), and one added to SamplingParams but not here fails
# tests/model/test_sampling_params.py, which enumerates the fields.
NEUTRAL: dict[str, object] = {
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "logit_bias": (),
    "grammar": None,
}
# The fields that say how to draw, not what from: the temperature (every path divides by it;
# below MIN_TEMPERATURE a row is greedy) and the seed of its uniforms.
HOW_TO_DRAW = ("temperature", "seed")
