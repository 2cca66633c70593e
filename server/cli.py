"""Moved: the ``ordinal`` command is the top-level module ``ordinal`` (``ordinal.py``).

Kept as a re-export so ``python -m server.cli`` and older imports keep working; new code should
use ``ordinal`` (this module is the only place ``server`` touches it).
"""

from __future__ import annotations

import sys

from ordinal import COMMANDS, build_parser, main

__all__ = ["COMMANDS", "build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
