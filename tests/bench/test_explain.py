"""bench/explain.py and bench/trace.py run against the shipped checkpoints (a short run each):
the benchmarks the docs quote stay runnable."""

from __future__ import annotations

import re

import pytest

from bench import explain
from bench import trace as bench_trace


def test_the_explain_bench_prints_a_row_per_scheme(capsys: pytest.CaptureFixture[str]) -> None:
    explain.main(["--schemes", "rope", "--tokens", "12", "--repeats", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| rope |")]
    assert len(rows) == 1
    numbers = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", rows[0])]
    assert numbers[2] == 12 and all(value > 0 for value in numbers[:2])


def test_the_trace_bench_prints_a_row_per_encoding(capsys: pytest.CaptureFixture[str]) -> None:
    bench_trace.main(["--schemes", "alibi", "--tokens", "16", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "| alibi | uint8 |" in out and "| alibi | lists |" in out
