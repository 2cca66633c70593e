"""The seeds' claims about each scheme, put to the task results: what each claim predicts the
tasks will show, and whether they show it.

Every verdict is computed from a :class:`~lab.tasks.results.Summary` with the thresholds
below; none is typed by hand. Two measurements carry them:

- **retention** at a test length: the share of its margin above chance at L that a model keeps
  there (1 = as good as at L, 0 = chance);
- **past-L retention**: in the 2L test of a stationary task (``Task.stationary``: counting,
  flip-flop), accuracy on the answers at positions ≥ L against those < L, relative to chance.
  It isolates the positions themselves: the content before an answer is of the same kind on
  both sides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lab.tasks import TASKS
from lab.tasks.results import Summary

# A task counts as learned at L when the mean accuracy there covers half the way from chance
# to 1; a claim about extrapolation is only tested on tasks the scheme learned.
LEARNED = 0.5
# Keeping this share of the margin (or more) is "holds"; below FAILS is "fails".
HOLDS, FAILS = 0.8, 0.5
# binary: the window of positions on each side of L over which an abrupt change is looked for.
CLIFF_WINDOW = 0.25  # × L

SUPPORTED, NOT_SUPPORTED, PARTLY = "supported", "not supported", "partly"


@dataclass(frozen=True)
class Verdict:
    """A verdict on one task and the figure behind it (e.g. "kept 0.12 at 2L")."""

    outcome: str  # SUPPORTED, NOT_SUPPORTED, PARTLY, or "n/a"
    evidence: str

    def cell(self) -> str:
        return f"{self.outcome} ({self.evidence})" if self.evidence else self.outcome


def learned(summary: Summary) -> bool:
    return summary.margin(summary.length) >= LEARNED * (1 - summary.chance)


def _learned_retention(summary: Summary, test_length: int) -> float:
    """Retention at ``test_length`` of a task learned at L, which has a margin there."""
    kept = summary.retention(test_length)
    assert kept is not None, "a task learned at L has a margin above chance there"
    return kept


def _graded(value: float, high_supports: bool) -> str:
    """SUPPORTED / PARTLY / NOT_SUPPORTED for a retention ``value``."""
    if FAILS <= value < HOLDS:
        return PARTLY
    return SUPPORTED if (value >= HOLDS) == high_supports else NOT_SUPPORTED


def _not_learned(summary: Summary) -> Verdict | None:
    if learned(summary):
        return None
    return Verdict("n/a", f"not learned at L: {summary.mean(summary.length):.2f}")


def extrapolation(summary: Summary, high_supports: bool) -> Verdict:
    """Retention at every test length past L: the smallest decides (HOLDS / FAILS)."""
    if (missing := _not_learned(summary)) is not None:
        return missing
    longer = sorted(test for test in summary.accuracy if test > summary.length)
    kept = [_learned_retention(summary, test) for test in longer]
    evidence = ", ".join(
        f"{k:.2f} at {t // summary.length}L" for k, t in zip(kept, longer, strict=True)
    )
    return Verdict(_graded(min(kept), high_supports), f"kept {evidence}")


def past_l_retention(summary: Summary) -> float | None:
    """Past-L retention in the 2L test (module docstring); None where a side has no answers or
    the model has no margin before L."""
    length = summary.length
    if not TASKS[summary.task].stationary or 2 * length not in summary.accuracy:
        return None
    before = summary.window(2 * length, 0, length)
    past = summary.window(2 * length, length, 2 * length)
    if before is None or past is None or before <= summary.chance:
        return None
    return (past - summary.chance) / (before - summary.chance)


def past_l(summary: Summary, high_supports: bool, whole_test: bool) -> Verdict:
    """Past-L retention; with ``whole_test``, a task with answers past L only (recall, copy)
    is judged by its retention over the whole 2L test instead."""
    if (missing := _not_learned(summary)) is not None:
        return missing
    kept = past_l_retention(summary)
    if kept is not None:
        return Verdict(_graded(kept, high_supports), f"kept {kept:.2f} past L")
    if whole_test and 2 * summary.length in summary.accuracy:
        kept = _learned_retention(summary, 2 * summary.length)
        return Verdict(_graded(kept, high_supports), f"kept {kept:.2f} at 2L, all past L")
    return Verdict("n/a", "not a stationary task")


def cliff(summary: Summary) -> Verdict:
    """An abrupt change at L: in the 2L test, the share of the margin above chance lost between
    the positions just before L and those just after (CLIFF_WINDOW × L each)."""
    if (missing := _not_learned(summary)) is not None:
        return missing
    length, width = summary.length, max(1, round(CLIFF_WINDOW * summary.length))
    if not TASKS[summary.task].stationary or 2 * length not in summary.accuracy:
        return Verdict("n/a", "not a stationary task")
    before = summary.window(2 * length, length - width, length)
    after = summary.window(2 * length, length, length + width)
    if before is None or after is None or before <= summary.chance:
        return Verdict("n/a", "no answers on both sides of L")
    lost = (before - after) / (before - summary.chance)
    return Verdict(_graded(1 - lost, high_supports=False), f"{before:.2f} → {after:.2f} across L")


@dataclass(frozen=True)
class Claim:
    """A seed's claim about ``scheme``, what the tasks would show if it holds, and the test."""

    scheme: str
    claim: str
    prediction: str
    judge: Callable[[Summary], Verdict]


CLAIMS = (
    Claim(
        "integer",
        "cannot extrapolate",
        f"retention below {FAILS} by the longest test",
        lambda s: extrapolation(s, high_supports=False),
    ),
    Claim(
        "binary",
        "is not smooth",
        f"an abrupt drop at L: over half the margin lost within {CLIFF_WINDOW}·L of it",
        cliff,
    ),
    Claim(
        "sinusoidal",
        "relative shifts are linear (PE(p+k) = M_k·PE(p))",
        f"if the model attends through M_k, past-L retention ≥ {HOLDS}",
        lambda s: past_l(s, high_supports=True, whole_test=False),
    ),
    *(
        Claim(
            scheme,
            statement,
            f"retention past L below {FAILS}",
            lambda s: past_l(s, high_supports=False, whole_test=True),
        )
        for scheme, statement in (
            ("learned", "a learned table cannot go past its last (trained) row"),
            ("mds", "(a table too: the same claim)"),
            ("lowrank", "(a table too: the same claim)"),
        )
    ),
    Claim(
        "rope",
        "encodes relative distance",
        f"the same content scores alike before and past L: past-L retention ≥ {HOLDS}",
        lambda s: past_l(s, high_supports=True, whole_test=False),
    ),
    Claim(
        "alibi",
        "extrapolates",
        f"retention ≥ {HOLDS} at every length past L",
        lambda s: extrapolation(s, high_supports=True),
    ),
)


def overall(verdicts: list[Verdict]) -> str:
    """``supported on 2 of 3 tasks tested (partly on 1)``, counting only tasks with a verdict."""
    tested = [v.outcome for v in verdicts if v.outcome != "n/a"]
    if not tested:
        return "not tested"
    counts = [(outcome, tested.count(outcome)) for outcome in (SUPPORTED, PARTLY, NOT_SUPPORTED)]
    parts = [f"{outcome} on {n}" for outcome, n in counts if n]
    return f"{', '.join(parts)} of {len(tested)} tasks tested"
