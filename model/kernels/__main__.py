"""Build kernel variants: ``python -m model.kernels [--all | ISA ...]``.

With no ISA, every variant this CPU runs (``make setup``); ``--all``, every variant of this
architecture (the Docker image's build stage: the image then runs the fastest one that the CPU
it lands on has).
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys

from model.cpu import ARCHITECTURE_ISAS, IsaError, runnable
from model.kernels import ISA_FLAGS, build_all


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.kernels", description=__doc__)
    parser.add_argument(
        "isas",
        nargs="*",
        metavar="ISA",
        help=f"the variants to build, of {', '.join(ISA_FLAGS)} (default: those this CPU runs, "
        f"here {', '.join(runnable()) or 'none'})",
    )
    parser.add_argument(
        "--all", action="store_true", help="every variant of this architecture, run or not"
    )
    args = parser.parse_args(argv)
    isas = args.isas or None
    if args.all:
        if args.isas:
            parser.error("give --all or ISAs, not both")
        isas = list(ARCHITECTURE_ISAS.get(platform.machine(), ()))
    try:
        build_all(isas)
    except IsaError as error:
        parser.error(str(error))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        print(f"python -m model.kernels: error: the build failed: {first_line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
