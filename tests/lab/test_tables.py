"""The READMEs' scheme tables (lab/tables.py) are what the checkpoints' files say, never typed."""

from __future__ import annotations

import pytest

from lab import tables
from model.positional import SCHEMES


def test_both_readmes_tables_are_what_the_checkpoint_files_say(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert tables.main(["--check"]) == 0, capsys.readouterr().out


def test_every_shipped_checkpoint_has_a_row_in_both_tables() -> None:
    folders = [folder.name for folder in tables.shipped_folders()]
    for path, text in tables.generated().items():
        table = text.split("<!-- scheme table:")[1].split("<!-- end of scheme table -->")[0]
        rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
        unshipped = set(SCHEMES) - set(folders) if path == tables.README else set()
        assert len(rows) == len(folders) + len(unshipped), path
        for name in unshipped:  # a registered scheme no checkpoint ships says so
            assert any(row.startswith(f"| `{name}`") and "not shipped" in row for row in rows)
        for name in folders:
            assert any(row.startswith((f"| `{name}`", f"| {name} ")) for row in rows), (path, name)


def test_a_table_is_replaced_between_its_markers_only() -> None:
    begin, end = "<!-- scheme table: x (python -m lab.tables) -->", "<!-- end of scheme table -->"
    text = f"before\n{begin}\n| old |\n{end}\nafter"
    new = tables.replace_between_markers(text, "x", ["| new |"])
    assert new.startswith("before\n<!-- scheme table: x") and new.endswith("-->\nafter")
    assert "| new |" in new and "| old |" not in new
    with pytest.raises(ValueError, match="no <!-- scheme table: y"):
        tables.replace_between_markers(text, "y", ["| new |"])
