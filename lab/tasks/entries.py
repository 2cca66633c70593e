"""The suite's entries: what one line of docs/tasks.md trains. Every registered scheme is an
entry of its own name, and some entries are a scheme with a recipe of its own.

- ``prope`` (Barbero et al. 2025, p-RoPE): rope keeping the highest 0.75 of its frequencies,
  the rest left unrotated (rope's ``fraction``);
- ``drope`` (Gelberg et al. 2025, DroPE): rope trained with the suite's budget, then its
  positions removed (the same weights under ``none``, as ``ordinal train --scheme none --init``
  does) and the model recalibrated at the training length for ``recalibration`` × the steps,
  with a fresh optimiser on the same schedule shape, its warmup scaled alike. 0.1, the share
  the shipped ``drope`` checkpoint recalibrates for (200 of 2,000 steps: checkpoints/README.md);
- ``irope``: the scheme with a schedule for the suite's two layers, rope then NoPE (its
  default, a NoPE layer every fourth, would leave both rope), the NoPE layer's temperature
  from L = 32;
- ``fox-slow``: fox with its gates starting near 1 (bias 3: σ(3) ≈ 0.95 per token) instead of
  the paper's 1/2, which leaves a key 20 tokens back e⁻¹⁴ of its score at the start: whether
  fox's failure to learn copy at L comes from where its gates start.

An entry's recipe is saved with its results (``Entry.recipe``), so ``--reuse`` retrains one
whose recipe changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from model.config import TrainConfig
from model.positional import SCHEMES


@dataclass(frozen=True)
class Entry:
    """A scheme with parameters over the suite's own (``parameters``); with ``continued_as``, a
    second phase under that scheme for ``recalibration`` × the training steps."""

    name: str
    scheme: str
    parameters: Mapping[str, Any] = field(default_factory=dict)
    continued_as: str | None = None
    recalibration: float = 0.0

    def recipe(self) -> dict[str, Any] | None:
        """What the result file records of the entry; None for a plain scheme (its recipe is
        the suite's settings alone)."""
        if self.name == self.scheme and not self.parameters and self.continued_as is None:
            return None
        recipe: dict[str, Any] = {"scheme": self.scheme, "parameters": dict(self.parameters)}
        if self.continued_as is not None:
            recipe |= {"continued_as": self.continued_as, "recalibration": self.recalibration}
        return recipe

    def recalibration_recipe(self, train: TrainConfig) -> TrainConfig:
        """The second phase's recipe: ``recalibration`` × the steps (at least one), warmup
        scaled alike."""
        return dataclasses.replace(
            train,
            steps=max(1, round(self.recalibration * train.steps)),
            warmup_steps=round(self.recalibration * train.warmup_steps),
        )


def describe(recipe: dict[str, Any], steps: int) -> str:
    """A result's recorded recipe (``Entry.recipe``) in words, for a run of ``steps`` steps."""
    words = recipe["scheme"] + "".join(
        f" with {key} {value}" for key, value in recipe["parameters"].items()
    )
    if "continued_as" in recipe:
        share = recipe["recalibration"]
        words += (
            f" for {steps} steps, then continued as {recipe['continued_as']} for {share:g} × "
            f"as many ({max(1, round(share * steps))} steps: a fresh optimiser, the same "
            "schedule shape)"
        )
    return words


# The suite's model has two layers: irope's default (Llama 4's NoPE every fourth layer) would
# leave both rope. Here the second is NoPE, its temperature from the full suite's L = 32.
IROPE_SCHEDULE = {"layers": "rope,none", "temperature_floor": 32}

ENTRIES: dict[str, Entry] = {
    **{name: Entry(name, name) for name in SCHEMES},
    "irope": Entry("irope", "irope", IROPE_SCHEDULE),
    "prope": Entry("prope", "rope", {"fraction": 0.75}),
    "drope": Entry("drope", "rope", continued_as="none", recalibration=0.1),
    "fox-slow": Entry("fox-slow", "fox", {"bias_init": 3.0}),
}
