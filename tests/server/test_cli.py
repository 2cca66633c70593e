"""The ``ordinal`` command: help for every subcommand, bad input as a one-line message with exit
status 2 (never a traceback), Ctrl-C as 130, and ``ordinal geometry`` writing its report."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import NoReturn

import pytest

import model.evaluate
import server.app
from model.geometry.report import REPORT_FILE
from model.positional import SCHEMES
from server.cli import COMMANDS, main


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

    monkeypatch.setattr(server.app.uvicorn, "run", must_not_serve)
    checkpoints = tmp_path / folder
    assert main(["serve", "--checkpoints", str(checkpoints)]) == 2
    err = one_line_error(capsys, "serve")
    assert str(checkpoints) in err and message in err


def test_ctrl_c_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(args: argparse.Namespace) -> NoReturn:
        raise KeyboardInterrupt

    monkeypatch.setattr(model.evaluate, "run", interrupted)
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

    monkeypatch.setattr(server.app.uvicorn, "run", must_not_serve)
    monkeypatch.setenv("ORDINAL_API_KEY", key)
    assert main(["serve"]) == 2
    err = one_line_error(capsys, "serve")
    assert "api_key" in err and "empty or blank" in err
