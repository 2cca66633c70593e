"""The ``ordinal`` command: serve, train, eval and geometry.

Each subcommand's options live next to the code they configure (``add_arguments``); this module
only dispatches, and is the one place that turns a bad input into a message and a non-zero exit.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib import import_module

# subcommand → (module, help). Modules are imported lazily so `ordinal train` never loads FastAPI.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("server.app", "serve the checkpoints over HTTP"),
    "train": ("model.train", "train one checkpoint on the Shakespeare corpus"),
    "eval": ("model.evaluate", "validation loss, bits per character and loss by position"),
    "geometry": ("model.geometry.report", "positional geometry report of a corpus and schemes"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ordinal", description="A text-generation service with ten positional encodings."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = import_module(module_name)
        sub = commands.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], object] = args.run
    try:
        run(args)
    except (ValueError, OSError) as error:  # every input error the packages raise is a ValueError
        print(f"ordinal {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
