"""Markdown tables, as every report of ordinal writes them (eval, geometry, tasks, benchmarks)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """The table's lines: the header, its rule, then one line per row (cells already text)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return [*lines, *("| " + " | ".join(row) + " |" for row in rows)]
