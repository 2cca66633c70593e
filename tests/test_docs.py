"""The README and docs/ point at things that exist: every relative link resolves to a file or
folder of the repository, and every test file or source file they name by path is there (a
module moved without its mention is caught here, not by a reader)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# A path named in prose or code: a file under one of the repository's own folders.
FOLDERS = "tests|model|server|lab|interop|bench|clients"
NAMED = re.compile(rf"(?<![\w/.])((?:{FOLDERS})/[a-z0-9_/]+\.py)\b")


def links(page: Path) -> list[str]:
    return [target for target in LINK.findall(page.read_text()) if "://" not in target]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_resolves(page: Path) -> None:
    missing = [target for target in links(page) if not (page.parent / target).exists()]
    assert missing == [], f"{page.name} links to what does not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_python_file_named_exists(page: Path) -> None:
    named = set(NAMED.findall(page.read_text()))
    missing = sorted(path for path in named if not (REPO / path).exists())
    assert missing == [], f"{page.name} names files that do not exist: {missing}"
