"""The ``ordinal`` command: help for every subcommand (fast: no torch, FastAPI or matplotlib;
choices and defaults shown, and those defaults the code's own), bad input as a one-line message
with exit status 2 (never a traceback), Ctrl-C as 130, and ``ordinal geometry`` writing its
report."""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import NoReturn

import pytest

import lab.evaluate
import lab.tasks
import lab.train
import model
import model.cpu as cpu
import ordinal
import server.api.app
from lab.geometry import report as geometry_report
from lab.geometry.report import REPORT_FILE
from lab.tasks import suite as tasks_suite
from model.positional import SCHEMES
from ordinal import COMMANDS, build_parser, main
from server.api.settings import Settings

HEAVY = ("torch", "fastapi", "uvicorn", "matplotlib", "server.api.app")


def one_line_error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The captured stderr, checked to be ``ordinal COMMAND: error: ...`` on one line."""
    err = capsys.readouterr().err
    assert err.startswith(f"ordinal {command}: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", COMMANDS)
def test_help_of_each_subcommand_exits_0(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: ordinal {command}")


def test_missing_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert "usage: ordinal" in capsys.readouterr().err


def test_eval_of_a_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nonexistent"
    assert main(["eval", str(missing)]) == 2
    err = one_line_error(capsys, "eval")
    assert str(missing) in err and "is not a checkpoint" in err


def test_train_of_an_unknown_scheme_names_the_valid_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--scheme", "nope", "--out", str(tmp_path / "X")]) == 2
    err = one_line_error(capsys, "train")
    assert "'nope'" in err
    assert all(f"'{scheme}'" in err for scheme in SCHEMES)
    assert not (tmp_path / "X").exists()


@pytest.mark.parametrize(
    ("folder", "message"),
    [("nonexistent", "does not exist"), ("", "no checkpoints")],
    ids=["missing", "empty"],
)
def test_serve_without_checkpoints(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    folder: str,
    message: str,
) -> None:
    def must_not_serve(*args: object, **kwargs: object) -> NoReturn:
        raise AssertionError("the server started despite bad settings")

    monkeypatch.setattr(server.api.app.uvicorn, "run", must_not_serve)
    checkpoints = tmp_path / folder
    assert main(["serve", "--checkpoints", str(checkpoints)]) == 2
    err = one_line_error(capsys, "serve")
    assert str(checkpoints) in err and message in err


@pytest.mark.parametrize("variant", ["avx1024", "neon"])
def test_serve_with_a_kernel_variant_this_cpu_cannot_run(
    checkpoints: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    variant: str,
) -> None:
    """ORDINAL_CPU_ISA naming no variant, or one this CPU cannot run: one line, exit 2, before
    anything starts (never a server decoding with something else than it was told)."""

    def must_not_serve(*args: object, **kwargs: object) -> NoReturn:
        raise AssertionError("the server started despite a variant it cannot run")

    monkeypatch.setattr(server.api.app.uvicorn, "run", must_not_serve)
    monkeypatch.setenv(cpu.ENVIRONMENT, variant)
    cpu.chosen.cache_clear()
    try:
        assert main(["serve", "--checkpoints", str(checkpoints)]) == 2
    finally:
        cpu.chosen.cache_clear()
    err = one_line_error(capsys, "serve")
    assert f"ORDINAL_CPU_ISA={variant}: this CPU runs" in err


def test_ctrl_c_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(args: argparse.Namespace) -> NoReturn:
        raise KeyboardInterrupt

    monkeypatch.setattr(lab.evaluate, "run", interrupted)
    assert main(["eval", "anything"]) == 130


def test_geometry_writes_report_and_figures_within_a_minute(tmp_path: Path) -> None:
    started = time.process_time()  # CPU time of all threads: immune to a busy machine
    assert main(["geometry", "--corpus", "synthetic", "--out", str(tmp_path)]) == 0
    assert time.process_time() - started < 60

    report = json.loads((tmp_path / REPORT_FILE).read_text())
    assert report["figures"]
    for name in report["figures"]:
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG"), name
    assert {entry["scheme"] for entry in report["schemes"]} == set(SCHEMES)


@pytest.mark.parametrize("key", ["", "   ", "\t"])
def test_an_empty_api_key_is_a_start_up_error(
    key: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def must_not_serve(*args: object, **kwargs: object) -> NoReturn:
        raise AssertionError("the server started with an empty API key")

    monkeypatch.setattr(server.api.app.uvicorn, "run", must_not_serve)
    monkeypatch.setenv("ORDINAL_API_KEY", key)
    assert main(["serve"]) == 2
    err = one_line_error(capsys, "serve")
    assert "api_key" in err and "empty or blank" in err


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_loads_nothing_heavy_and_takes_under_a_second(command: str) -> None:
    code = (
        "import sys, ordinal\n"
        "try:\n"
        f"    ordinal.main({[command, '--help'] if command else ['--help']!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)\n"
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert result.stdout.startswith("usage: ordinal"), result.stderr
    assert result.stderr.strip() == "[]"  # only the module that runs a command imports them
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    assert cpu < 1.0  # CPU time, immune to a busy machine (about 0.2 s here)


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        ("serve", ["--device {auto,cpu,cuda}", "--dtype {float32,bfloat16,float16}"]),
        ("train", ["--device {auto,cpu,cuda}", "--storage-dtype {float32,bfloat16,float16}"]),
        ("eval", ["--device {auto,cpu,cuda}", "(default: 1 2 4)"]),
        ("geometry", ["--corpus {synthetic,shakespeare}", "(default: synthetic)"]),
        ("tasks", ["--seeds N", "(default: 3)", "(default: docs/tasks)", "recall,copy"]),
    ],
)
def test_help_shows_choices_and_defaults(
    command: str, shown: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for text in shown:
        assert text in out


def test_the_help_states_the_codes_own_defaults() -> None:
    """The lists ordinal.py still writes out (they live beside torch code, which --help must not
    import) are the code's. The schemes, the recipe's defaults, devices and dtypes it imports."""
    assert ordinal.CORPORA == geometry_report.CORPORA
    assert ordinal.EVAL_MULTIPLES == lab.evaluate.MULTIPLES
    assert tuple(lab.tasks.TASKS) == ordinal.TASKS
    suite = {"seeds": tasks_suite.DEFAULT_SEEDS, "jobs": tasks_suite.DEFAULT_JOBS}
    assert {**suite, "out": tasks_suite.DEFAULT_OUT} == ordinal.TASK_DEFAULTS


def test_serve_has_a_flag_per_setting() -> None:
    args = build_parser().parse_args(["serve"])
    assert vars(args) == {"command": "serve"}  # unset flags leave env vars and defaults
    for name, field in Settings.model_fields.items():
        choices = typing.get_args(field.annotation) if ordinal.is_literal(field.annotation) else ()
        value = choices[-1] if choices else "1"
        given = build_parser().parse_args(["serve", f"--{name.replace('_', '-')}", value])
        assert getattr(given, name) == value


def test_geometry_takes_checkpoints_either_way() -> None:
    """``--checkpoints A B`` (the README's spelling) beside the repeatable ``--checkpoint``."""
    both = ["geometry", "--out", "x", "--checkpoints", "a", "b", "--checkpoint", "c"]
    assert build_parser().parse_args(both).checkpoints == [Path("a"), Path("b"), Path("c")]


def test_the_dispatcher_lives_outside_the_packages() -> None:
    assert Path(ordinal.__file__).parent == Path(model.__file__).parent.parent


def test_a_setting_described_with_a_percent_sign_still_has_help(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """argparse formats help text with %: a description's own % (a measured gain, say) once made
    `ordinal serve --help` raise."""
    field = Settings.model_fields["attention_helper"]
    monkeypatch.setattr(field, "description", f"{field.description} (+9% here)")
    parser = argparse.ArgumentParser()
    ordinal.serve_options(parser)
    assert "(+9% here)" in parser.format_help()
