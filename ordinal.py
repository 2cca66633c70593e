"""The ``ordinal`` command: serve, train, eval, geometry, tasks, import and export.

This module only dispatches. It sits outside both import packages because it reaches into both
(``serve`` runs ``server.api.app``; ``train``, ``eval`` and ``geometry`` run ``model`` code), and
``model`` must never import ``server``. Each subcommand is its options and the
``module:function`` that runs it; that module is imported only when the command runs, so
``ordinal --help`` and every ``ordinal COMMAND --help`` load no torch, FastAPI or matplotlib
(importing torch alone takes ~2 s). ``serve``'s flags come from the settings model
(``server.api.settings``, pydantic only); ``train``'s recipe defaults, devices and dtypes come
from the torch-free ``model.config`` and ``model.device``. The lists that live beside torch code
(schemes, corpora, tasks) are written out below, and ``tests/server/test_cli.py`` checks them.

Bad input of any command is a one-line ``ordinal COMMAND: error: ...`` and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any

import model.positional
from model.config import (
    DEFAULT_PRESET,
    MODEL_SIZE_FLAGS,
    OPTIMIZERS,
    PRESETS,
    SCHEDULES,
    SEQUENCE_STARTS,
    TrainConfig,
)
from model.device import DEVICES, DTYPES

SCHEMES = tuple(model.positional.SCHEMES)  # the registry's names (its classes load on use)
# lab.geometry.report.CORPORA, in its order.
CORPORA = ("synthetic", "shakespeare")
# What --data (and geometry's --corpus PATH) reads: lab.text_corpus.
DATA_FORMS = "a text file, a folder of .txt files, or .jsonl with a text field"
# The recipe's defaults and choices, and the shipped preset's sizes that `ordinal train` takes
# as flags, read from model.config (torch-free: the schemes load only when a config is built).
TRAIN_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
TRAIN_CHOICES = {
    "optimizer": OPTIMIZERS,
    "sequence_starts": SEQUENCE_STARTS,
    "schedule": SCHEDULES,
}
MODEL_SIZE_DEFAULTS = {name: PRESETS[DEFAULT_PRESET].model[name] for name in MODEL_SIZE_FLAGS}
EVAL_MULTIPLES = (1, 2, 4)  # lab.evaluate.MULTIPLES
# lab.tasks.TASKS, in its order, and lab.tasks.suite's defaults.
TASKS = (
    "recall",
    "copy",
    "counting",
    "flipflop",
    "longcount",
    "periodic",
    "needle",
    "variables",
    "indirect",
)
TASK_DEFAULTS: dict[str, Any] = {"seeds": 3, "jobs": 2, "out": Path("docs/tasks")}
# lab.tasks.entries.ENTRIES (every scheme, then the suite's recipes) and the choices of
# --longest (lab.tasks.training.LONGEST, the first the default); tests/model/test_tasks_report.py
# checks them.
TASK_ENTRIES = (*SCHEMES, "prope", "drope", "fox-slow")
TASK_LONGEST = (4, 8)
# interop.hf_export.TARGETS (the first is the default) and the export formats.
EXPORT_TARGETS = ("auto", "native", "custom")
EXPORT_FORMATS = ("hf", "gguf")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, plus ``(default: X)`` wherever an option has a real default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" in text
            or not action.option_strings
            or default in (None, False, argparse.SUPPRESS)
        ):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, list | tuple) else default
        return f"{text} (default: {shown})".strip()


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def is_literal(annotation: object) -> bool:
    """Whether a settings field is a ``Literal[...]`` (its values become the flag's choices)."""
    return typing.get_origin(annotation) is typing.Literal


def serve_options(parser: argparse.ArgumentParser) -> None:
    """One flag per setting of ``server.api.settings.Settings``; an unset flag leaves the
    ``ORDINAL_*`` variable or the default (``server.api.app.settings_from_args`` reads them)."""
    from server.api.settings import Settings

    for name, field in Settings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        shown = f"; default {default}" if default not in (None, []) else ""
        # Choices are shown, not enforced here: the settings model checks every value, so a bad
        # one gets the same message from a flag as from its ORDINAL_* variable.
        choices = typing.get_args(field.annotation) if is_literal(field.annotation) else ()
        parser.add_argument(
            flag(name),
            dest=name,
            default=argparse.SUPPRESS,
            metavar="{" + ",".join(choices) + "}" if choices else name.upper(),
            # argparse formats help with %: a description's own % would break --help
            help=f"{field.description} [env ORDINAL_{name.upper()}{shown}]".replace("%", "%%"),
        )


def force_option(parser: argparse.ArgumentParser, what: str, kind: str) -> None:
    """``--force``: the one override of where a command may write (``model.files.check_output``),
    which never extends to what the command reads, a model folder it would write inside, or
    one it would delete."""
    parser.add_argument(
        "--force",
        action="store_true",
        help=f"replace {what} even when it is not {kind} (never what this command reads, a "
        "checkpoint or a folder holding one, nor a path inside one)",
    )


def train_options(parser: argparse.ArgumentParser) -> None:
    """Options of ``ordinal train`` (``lab.train.run``)."""
    parser.add_argument(
        "--scheme", required=True, metavar="SCHEME", help="positional scheme: " + ", ".join(SCHEMES)
    )
    parser.add_argument(
        "--out",
        required=True,
        type=Path,
        help="checkpoint folder to write (an existing checkpoint is replaced, its eval.json "
        "and metrics.json dropped)",
    )
    force_option(parser, "OUT", "a checkpoint")
    parser.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=DEFAULT_PRESET,
        help="named recipe: architecture and training settings (model.config.PRESETS)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        help='JSON file: {"model": {...}, "train": {...}}, over the preset',
    )
    parser.add_argument(
        "--data",
        type=Path,
        metavar="PATH",
        help="train on your own text instead of Shakespeare: " + DATA_FORMS,
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="tokenizer.json to use; trained on the training split if missing (default "
        "runs/tokenizer.json; with --data, one trained on that text, kept in the checkpoint)",
    )
    parser.add_argument(
        "--state-dir", type=Path, help="where resumable training state goes (default runs/OUT)"
    )
    parser.add_argument("--resume", action="store_true", help="continue from the saved state")
    parser.add_argument(
        "--init",
        type=Path,
        metavar="CHECKPOINT",
        help="start from this checkpoint's weights, all but its positional ones, and its "
        "tokenizer (the same architecture); DroPE: --scheme none --init checkpoints/rope",
    )
    parser.add_argument(
        "--stop-at",
        type=int,
        help="save and stop after this step (the schedule still runs to --steps; resume later)",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="auto = cuda when available; under torchrun each process takes cuda:LOCAL_RANK",
    )
    parser.add_argument(
        "--storage-dtype", choices=DTYPES, default="bfloat16", help="dtype of the saved weights"
    )
    parser.add_argument(
        "--positional",
        type=json.loads,
        help="scheme parameters as JSON, e.g. '{\"base\": 500}'",
    )
    group = parser.add_argument_group(
        "recipe (a flag beats the --config file, which beats the preset; defaults shown are the "
        "shipped preset's)"
    )
    notes = {
        "batch_size": " (global: split across torchrun processes)",
        "compile": " (torch.compile the forward and loss: faster, not bit-identical)",
    }
    for name, default in TRAIN_DEFAULTS.items():
        note = notes.get(name, "")
        if isinstance(default, bool):  # --compile / --no-compile; neither: the preset's
            group.add_argument(
                flag(name), action=argparse.BooleanOptionalAction, help=f"default {default}{note}"
            )
            continue
        choices = TRAIN_CHOICES.get(name)
        group.add_argument(
            flag(name),
            type=type(default),
            choices=choices,
            metavar=None if choices else "N" if isinstance(default, int) else "X",
            help=f"default {default}{note}",
        )
    for name, default in MODEL_SIZE_DEFAULTS.items():
        group.add_argument(flag(name), type=int, metavar="N", help=f"default {default}")


def _comma_ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        message = f"{text!r} is not a comma-separated list of integers"
        raise argparse.ArgumentTypeError(message) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive multiples, e.g. 1,2,4,8")
    return values


def _rope_variants(text: str) -> list[tuple[str, str, float]]:
    """ "yarn4,ntk2" → [("yarn4", "yarn", 4.0), ("ntk2", "ntk", 2.0)] (pydantic only, no torch)."""
    from server.messages import parse_rope_variant

    variants = [part.strip() for part in text.split(",") if part.strip()]
    try:
        return [(variant, *parse_rope_variant(variant)) for variant in variants]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def eval_options(parser: argparse.ArgumentParser) -> None:
    """Options of ``ordinal eval`` (``lab.evaluate.run``)."""
    parser.add_argument(
        "checkpoints",
        nargs="+",
        type=Path,
        metavar="CHECKPOINT",
        help="checkpoint folders (files among them, such as checkpoints/README.md, are skipped)",
    )
    parser.add_argument("--plot", type=Path, help="write a PNG of loss by position to this path")
    lengths = parser.add_mutually_exclusive_group()
    lengths.add_argument(
        "--lengths",
        dest="multiples",
        type=_comma_ints,
        default=list(EVAL_MULTIPLES),
        metavar="M,M,...",
        help="window lengths as multiples of the training context, e.g. 1,2,4,8",
    )
    lengths.add_argument(
        "--multiples", dest="multiples", type=int, nargs="+", metavar="M", help="as --lengths"
    )
    parser.add_argument(
        "--rope-variants",
        type=_rope_variants,
        default=[],
        metavar="VARIANT,...",
        help="also score every rope checkpoint under these context extensions, on the same "
        "weights (SCALING+FACTOR: linear, ntk, dynamic or yarn; e.g. yarn4,ntk4)",
    )
    parser.add_argument("--table", type=Path, help="write a markdown table of the results here")
    force_option(parser, "the --plot and --table files", "an earlier plot or table")
    parser.add_argument(
        "--save",
        action="store_true",
        help="write each checkpoint's eval.json (left byte-identical when the weights and the "
        "results are unchanged)",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="take a checkpoint's eval.json instead of evaluating when it was made from the same "
        "weights (SHA-256 of model.safetensors' tensors) and has every multiple",
    )
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="auto = cuda if present")
    parser.add_argument("--batch-size", type=int, default=16, metavar="N", help="windows per pass")
    parser.add_argument(
        "--data",
        type=Path,
        metavar="PATH",
        help="score on the validation split of your own text (as `ordinal train --data` held "
        "it out) instead of Shakespeare's validation plays",
    )


def geometry_options(parser: argparse.ArgumentParser) -> None:
    """Options of ``ordinal geometry`` (``lab.geometry.report.run``)."""
    parser.add_argument(
        "--out",
        required=True,
        type=Path,
        help="folder for report.json and PNGs (written whole: an earlier report is replaced)",
    )
    force_option(parser, "OUT", "an earlier report")
    parser.add_argument(
        "--corpus",
        default=CORPORA[0],
        metavar="{" + ",".join(CORPORA) + "} or PATH",
        help="corpus measured: a named one, or your own text's training split (" + DATA_FORMS + ")",
    )
    parser.add_argument(
        "--checkpoints",
        "--checkpoint",
        dest="checkpoints",
        action="extend",
        nargs="+",
        type=Path,
        default=[],
        metavar="CHECKPOINT",
        help="checkpoint folders whose trained schemes to measure (default: every scheme, "
        "untrained)",
    )
    parser.add_argument("--n-positions", type=int, metavar="N", help="positions analysed")
    parser.add_argument(
        "--d-model", type=int, default=128, metavar="N", help="width of untrained schemes"
    )
    parser.add_argument("--seed", type=int, default=0, metavar="N", help="random seed")
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="tokenizer.json for the shakespeare corpus (default: the first checkpoint's)",
    )


def tasks_options(parser: argparse.ArgumentParser) -> None:
    """Options of ``ordinal tasks`` (``lab.tasks.suite.run``)."""
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny budget (a one-layer model, a few steps): the whole pipeline in seconds",
    )
    parser.add_argument(
        "--schemes", metavar="SCHEME,...", help="default all: " + ",".join(TASK_ENTRIES)
    )
    parser.add_argument("--tasks", metavar="TASK,...", help="default all: " + ",".join(TASKS))
    parser.add_argument(
        "--seeds",
        type=int,
        default=TASK_DEFAULTS["seeds"],
        metavar="N",
        help="seeds 0..N-1 per scheme and task (mean ± spread over them)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=TASK_DEFAULTS["out"],
        help="folder of the results (TASK-SCHEME.json) and plots; the page goes beside it, OUT.md",
    )
    parser.add_argument(
        "--longest",
        type=int,
        choices=TASK_LONGEST,
        default=TASK_LONGEST[0],
        help="the longest test, in multiples of the trained length L (1L, 2L, ... doubling to it)",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="skip each (scheme, task) whose result in OUT has the same settings and seeds",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=TASK_DEFAULTS["jobs"],
        metavar="N",
        help="worker processes, one thread each",
    )


def import_options(parser: argparse.ArgumentParser) -> None:
    """Options of ``ordinal import`` (``interop.hf_import.run``)."""
    parser.add_argument(
        "source",
        metavar="HF_FOLDER",
        help="a Hugging Face model folder (GPT2LMHeadModel or LlamaForCausalLM, safetensors "
        "weights, tokenizer.json; or one ordinal export wrote, which imports back as its "
        "checkpoint); a hub name (owner/model) is downloaded only if no such "
        "folder exists and the hub can be reached",
    )
    parser.add_argument(
        "out",
        type=Path,
        metavar="OUT",
        help="checkpoint folder to write (an existing checkpoint is replaced, its eval.json and "
        "metrics.json dropped; never the source folder)",
    )
    force_option(parser, "OUT", "a checkpoint")
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="dtype of the saved weights (default: the folder's; a folder ordinal export wrote: "
        "its checkpoint's, which imports back exactly)",
    )


def export_options(parser: argparse.ArgumentParser) -> None:
    """Options of ``ordinal export`` (``interop.hf_export.run``)."""
    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT", help="checkpoint folder")
    parser.add_argument(
        "out",
        type=Path,
        metavar="OUT",
        help="folder to write (a .gguf file with --format gguf); an earlier export there is "
        "replaced whole, anything else only with --force",
    )
    force_option(parser, "OUT", "an earlier export")
    parser.add_argument(
        "--format",
        choices=EXPORT_FORMATS,
        default=EXPORT_FORMATS[0],
        help="hf: a Hugging Face folder (transformers, vLLM); gguf: a llama.cpp file (rope only)",
    )
    parser.add_argument(
        "--target",
        choices=EXPORT_TARGETS,
        default=EXPORT_TARGETS[0],
        help="hf: auto = a native architecture where one is exact (rope: Nemotron; none and the "
        "table schemes: GPT-2), else custom code (trust_remote_code); native refuses when none "
        "is exact; custom always writes the port",
    )


@dataclass(frozen=True)
class Command:
    """A subcommand: its one-line help, its options, and what runs it (imported on use)."""

    help: str
    options: Callable[[argparse.ArgumentParser], None]
    runner: str  # "module:function", called with the parsed arguments

    def load(self) -> Callable[[argparse.Namespace], Any]:
        module, function = self.runner.split(":")
        return getattr(import_module(module), function)


COMMANDS: dict[str, Command] = {
    "serve": Command("serve the checkpoints over HTTP", serve_options, "server.api.app:run"),
    "train": Command(
        "train one checkpoint on the Shakespeare corpus or your own text (also under torchrun)",
        train_options,
        "lab.train:run",
    ),
    "eval": Command(
        "validation loss, bits per character and loss by position",
        eval_options,
        "lab.evaluate:run",
    ),
    "geometry": Command(
        "positional geometry report of a corpus and schemes",
        geometry_options,
        "lab.geometry.report:run",
    ),
    "tasks": Command(
        "train and test every scheme on synthetic tasks at 1x, 2x, 4x the trained length",
        tasks_options,
        "lab.tasks.suite:run",
    ),
    "import": Command(
        "convert a Hugging Face GPT-2 or Llama-family model into a checkpoint folder",
        import_options,
        "interop.hf_import:run",
    ),
    "export": Command(
        "write a checkpoint as a Hugging Face folder (transformers, vLLM) or a GGUF (llama.cpp)",
        export_options,
        "interop.hf_export:run",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ordinal",
        description=f"A text-generation service with {len(SCHEMES)} positional schemes.",
        formatter_class=HelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        sub = commands.add_parser(
            name, help=command.help, description=command.help, formatter_class=HelpFormatter
        )
        command.options(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command].load()(args)
    except (ValueError, OSError) as error:  # every input error the packages raise is a ValueError
        print(f"ordinal {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
