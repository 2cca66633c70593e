"""Each process imports only its own half: the API process no torch, the engine process no web
stack, and ``ordinal --help`` neither (while still showing every default). Each check runs in a
fresh interpreter, since this one has imported everything."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from model.config import DEFAULT_PRESET, PRESETS, TrainConfig
from server.api.settings import Settings

WEB_STACK = ("fastapi", "starlette", "uvicorn", "server.api")


def imported_after(code: str, names: tuple[str, ...]) -> tuple[list[str], str]:
    """Which of ``names`` (or their submodules) a fresh interpreter holds after ``code``, and
    what ``code`` printed."""
    probe = (
        f"{code}\nimport sys\n"
        f"found = sorted(n for n in {names!r} if any(m == n or m.startswith(n + '.') "
        "for m in sys.modules))\n"
        "print('IMPORTED', *found, file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    line = [ln for ln in result.stderr.splitlines() if ln.startswith("IMPORTED")]
    assert line, result.stderr
    return line[-1].split()[1:], result.stdout


def test_the_api_process_imports_no_torch() -> None:
    found, _ = imported_after("import server.api.app", ("torch", "safetensors", "server.engine"))
    assert found == []


def test_the_engine_process_imports_no_web_stack() -> None:
    # The engine's entry point, as server.api.client.Launcher names it.
    found, _ = imported_after("import server.engine.core", WEB_STACK)
    assert found == []
    # Its own torch is there: the probe sees what a module imports.
    assert imported_after("import server.engine.core", ("torch",))[0] == ["torch"]


def test_the_engine_process_imports_no_template_engine_nor_the_lab() -> None:
    """The engine loads checkpoints and never renders a chat (the API process does) nor trains:
    neither jinja2 nor the lab nor the doors are in its closure."""
    found, _ = imported_after("import server.engine.core", ("jinja2", "lab", "interop"))
    assert found == []


def help_of(command: str) -> str:
    """``ordinal COMMAND --help``, run in a fresh interpreter that must import no torch or
    FastAPI; the text with argparse's line wrapping undone."""
    code = (
        f"import ordinal\ntry:\n    ordinal.main([{command!r}, '--help'])\n"
        "except SystemExit:\n    pass"
    )
    found, out = imported_after(code, ("torch", "fastapi", "starlette"))
    assert found == []
    return " ".join(out.split())


def shows_default(text: str, flag: str, default: object) -> bool:
    """Whether the help of ``flag`` (within the text after it) names ``default``."""
    pattern = rf"{re.escape(flag)}\b.{{0,80}}?default:? {re.escape(str(default))}\b"
    return re.search(pattern, text) is not None


def test_train_help_shows_every_default_of_the_recipe() -> None:
    text = help_of("train")
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        assert shows_default(text, flag, getattr(TrainConfig(), field.name)), flag
    sizes = PRESETS[DEFAULT_PRESET].model
    for name in ("d_model", "n_layers", "n_heads", "d_ff", "context_length", "max_positions"):
        assert shows_default(text, "--" + name.replace("_", "-"), sizes[name]), name


@pytest.mark.parametrize("name", ["max_batch_size", "prefill_chunk", "device", "dtype", "port"])
def test_serve_help_shows_the_settings_defaults(name: str) -> None:
    text = help_of("serve")
    default = Settings.model_fields[name].get_default(call_default_factory=True)
    assert f"ORDINAL_{name.upper()}; default {default}]" in text
