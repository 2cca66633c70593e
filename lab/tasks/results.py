"""The result files of ``ordinal tasks`` and the figures read from them.

A result (``OUT/TASK-SCHEME.json``) holds, for one scheme and task, the settings it was made
with, chance at every test length, the number of answers at each position of each test length
(``answers[T]`` [T]) and, per seed, how many of them the model got right (``correct[s][T]``
[T]). Every figure in docs/tasks.md is computed from these counts here: accuracy is exact match
on the answer tokens (greedy), pooled over the test sequences; mean and spread (the sample
standard deviation) are over seeds.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.tasks import TASKS
from lab.tasks.entries import ENTRIES


def result_path(out: Path, scheme: str, task_name: str) -> Path:
    return out / f"{task_name}-{scheme}.json"


def load_results(out: Path) -> list[dict[str, Any]]:
    """Every result in ``out``, in task then entry order (the registries' orders)."""
    found = [json.loads(path.read_text()) for path in sorted(out.glob("*-*.json"))]
    order = {(name, scheme): i for i, (name, scheme) in enumerate(_grid())}
    return sorted(found, key=lambda result: order.get((result["task"], result["scheme"]), 0))


def _grid() -> list[tuple[str, str]]:
    return [(name, scheme) for name in TASKS for scheme in ENTRIES]


@dataclass(frozen=True)
class Summary:
    """One scheme on one task: accuracy per seed at each test length, and chance at L."""

    scheme: str
    task: str
    length: int  # L, the training length
    accuracy: dict[int, list[float]]  # test length → accuracy of each seed
    chance: float
    result: dict[str, Any]

    @classmethod
    def of(cls, result: dict[str, Any]) -> Summary:
        length = result["settings"]["length"]
        accuracy = {
            int(test): [_test_accuracy(result, int(test), seed) for seed in range(_seeds(result))]
            for test in result["answers"]
        }
        return cls(
            result["scheme"],
            result["task"],
            length,
            accuracy,
            result["chance"][str(length)],
            result,
        )

    def mean(self, test_length: int) -> float:
        return statistics.fmean(self.accuracy[test_length])

    def spread(self, test_length: int) -> float:
        values = self.accuracy[test_length]
        return statistics.stdev(values) if len(values) > 1 else 0.0

    def margin(self, test_length: int) -> float:
        """How far above chance the mean accuracy is at ``test_length``."""
        return self.mean(test_length) - self.chance

    def retention(self, test_length: int) -> float | None:
        """The share of its margin above chance at L that the model keeps at ``test_length``
        (1 = as good as at L, 0 = chance); None when it has no margin at L."""
        margin = self.margin(self.length)
        return self.margin(test_length) / margin if margin > 0 else None

    def window(self, test_length: int, start: int, stop: int) -> float | None:
        """Mean over seeds of the accuracy on answers at positions start..stop−1 of the
        ``test_length`` test (None when no answer sits there)."""
        values = [
            window_accuracy(self.result, test_length, seed, start, stop)
            for seed in range(_seeds(self.result))
        ]
        found = [value for value in values if value is not None]
        return statistics.fmean(found) if len(found) == len(values) else None


def _seeds(result: dict[str, Any]) -> int:
    return len(result["correct"])


def _test_accuracy(result: dict[str, Any], test_length: int, seed: int) -> float:
    """Seed ``seed``'s accuracy over the whole ``test_length`` test."""
    accuracy = window_accuracy(result, test_length, seed)
    assert accuracy is not None, "every task puts answers in every test"
    return accuracy


def window_accuracy(
    result: dict[str, Any], test_length: int, seed: int, start: int = 0, stop: int | None = None
) -> float | None:
    """Seed ``seed``'s accuracy on the answers at positions start..stop−1 of the ``test_length``
    test (None when no answer sits there)."""
    key = str(test_length)
    answers = sum(result["answers"][key][start:stop])
    correct = sum(result["correct"][seed][key][start:stop])
    return correct / answers if answers else None


def format_mean(summary: Summary, test_length: int) -> str:
    """``0.97 ± 0.02`` (mean ± spread over seeds)."""
    return f"{summary.mean(test_length):.2f} ± {summary.spread(test_length):.2f}"
