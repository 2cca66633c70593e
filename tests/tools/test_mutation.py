"""tools/mutation.py, the driver of `make mutation` (docs/testing.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_driver_imports_no_package_it_mutates() -> None:
    # mutmut's run child executes this module; a `model` or `server` imported before mutmut puts
    # mutants/ first on sys.path is the unmutated copy, so no test would ever reach a mutant.
    code = "import sys, tools.mutation; print(sorted({'model', 'server'} & set(sys.modules)))"
    found = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert found.stdout.strip() == "[]"
