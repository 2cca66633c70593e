"""bench.decode times its runs interleaved: a noisy minute falls on every run alike.

The timings themselves are measurements (``make bench``); what is checked here is the order the
runs are timed in and which of their times each figure comes from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from bench import decode

CHECKPOINTS = Path(__file__).parents[2] / "checkpoints"


def test_every_round_runs_each_in_turn_after_one_warm_up_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    durations = {"ours": iter([9.0, 2.0, 4.0, 3.0]), "theirs": iter([9.0, 5.0, 8.0, 6.0])}

    def run(name: str) -> Callable[[], float]:
        def once() -> float:
            calls.append(name)
            return next(durations[name])

        return once

    monkeypatch.setattr(decode, "seconds", lambda once: once())  # a run's own duration
    rates = decode.time_interleaved({"ours": run("ours"), "theirs": run("theirs")}, 4, 3)

    assert calls == ["ours", "theirs"] * 4  # the warm-ups, then three rounds
    tokens = 4 * decode.NEW_TOKENS
    assert rates == {"ours": tokens / 2.0, "theirs": tokens / 5.0}  # each one's fastest round


def test_the_reference_is_timed_in_the_same_rounds_as_ours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """run() puts transformers' generate among the runs of each batch, not after them."""
    timed: list[list[str]] = []

    def interleaved(runs: dict[str, Callable[[], None]], batch: int, repeats: int) -> dict:
        timed.append(list(runs))
        return {name: float(batch) for name in runs}

    def nothing(*_: object) -> Callable[[], None]:
        return lambda: None

    monkeypatch.setattr(decode, "time_interleaved", interleaved)
    monkeypatch.setattr(decode, "our_decode", nothing)
    monkeypatch.setattr(decode, "transformers_decode", nothing)
    monkeypatch.setattr(decode, "rope_on_one_thread", lambda *_: 1.0)
    results = decode.run(CHECKPOINTS, 1, ["rope", "alibi"])

    for names in timed:
        assert names == ["rope", "alibi", "learned+bias", decode.TRANSFORMERS]
    for size in results["sizes"].values():
        assert size["transformers"] == {f"batch_{b}": float(b) for b in decode.BATCHES}
        assert set(size["ours"]) == {"rope", "alibi", "learned+bias"}
