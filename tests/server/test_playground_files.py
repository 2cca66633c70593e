"""The playground's files as they ship: every one is in the package (pyproject's package-data),
and its modules stay small (no function over 80 lines). That the page loads them, and works, is
the browser tests' (tests/browser); that the server serves each, test_trace.py's."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

from server.api.playground import STATIC

ROOT = Path(__file__).parents[2]
MAX_LINES = 80
# A top-level function: a declaration, or a const bound to an arrow function or its result.
DECLARATION = re.compile(r"^(?:export )?(?:async )?(?:function\*? (\w+)|const (\w+) = .*=> \{$)")


def test_every_file_of_the_page_is_in_the_package() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["server"]
    files = [path.relative_to(STATIC.parent).as_posix() for path in STATIC.rglob("*")]
    left_out = [
        name
        for name in files
        if (STATIC.parent / name).is_file()
        and not any(fnmatch.fnmatch(name, pattern) for pattern in patterns)
    ]
    assert len(files) > 10 and left_out == []


def functions(source: str) -> dict[str, int]:
    """Each top-level function of a module → its length in lines (to the first line that
    starts with "}", which closes it: the page's modules are formatted so)."""
    lengths, lines = {}, source.splitlines()
    for start, line in enumerate(lines):
        if found := DECLARATION.match(line):
            end = next(i for i in range(start, len(lines)) if lines[i].startswith("}"))
            lengths[found.group(1) or found.group(2)] = end - start + 1
    return lengths


def test_functions_lengths_are_measured() -> None:
    source = "const a = (x) => {\n  x;\n};\nexport async function b() {\n  if (c) {\n  }\n}\n"
    assert functions(source) == {"a": 3, "b": 4}


def test_no_function_of_the_page_is_longer_than_80_lines() -> None:
    modules = sorted(STATIC.glob("*.js"))
    measured = {
        f"{path.name}:{name}": n
        for path in modules
        for name, n in functions(path.read_text()).items()
    }
    assert len(modules) > 10 and len(measured) > 60  # the measure finds the page's functions
    assert {name: n for name, n in measured.items() if n > MAX_LINES} == {}
