"""Every command in README.md works as written.

The commands are the lines of its ``sh`` blocks, the Commands table, and inline ``make …`` and
``… --help`` spans. Each kind is checked by the quickest run that proves it: ``make`` as a dry run
(``make -n``), ``ordinal`` parsed by the real parser (globs expanded, the table's placeholders
filled in) and then checked the way the command starts (eval's folders, serve's settings), the
client and ``curl`` sent to a live server of tiny checkpoints, ``docker compose`` by the compose
tool when there is one (else its services and profiles), and any other module by its ``--help``.
A command of a new kind fails here until it gets a rule.
"""

from __future__ import annotations

import glob
import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

import model.evaluate
import ordinal
from server.api.app import settings_from_args
from tests.server.conftest import Running, running_server, test_settings
from tests.test_deploy import compose_tools

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
# The Commands table's placeholders, filled in with real values.
PLACEHOLDERS = {
    "NAME": "rope",
    "DIR": "runs/geometry",
    "shakespeare|synthetic": "shakespeare",
    "[--checkpoints …]": "--checkpoints checkpoints/rope checkpoints/alibi",
}


def shell_lines(text: str) -> Iterator[str]:
    """Each command of a shell block: a line, joined with the next while a quote is open."""
    pending = ""
    for line in text.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # "No closing quotation": the command goes on
            continue
        if pending.strip():
            yield pending.strip()
        pending = ""


def readme_commands() -> list[str]:
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", README, flags=re.S):
        commands += list(shell_lines(block))
    table = README.split("## Commands", 1)[1].split("\n## ", 1)[0]
    commands += re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)
    for span in re.findall(r"`([^`\n]+)`", README):
        if span.startswith("make ") or (span.startswith("ordinal ") and span.endswith("--help")):
            commands.append(span)
    return list(dict.fromkeys(commands))


COMMANDS = readme_commands()


def argv_of(command: str) -> tuple[dict[str, str], list[str]]:
    """(environment assignments, argv) of a command, placeholders filled and globs expanded."""
    command = command.replace("\\|", "|")  # escaped for the markdown table
    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    words = shlex.split(command, comments=True)
    environment = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        name, value = words.pop(0).split("=", 1)
        environment[name] = value
    argv = []
    for word in words:
        matches = sorted(glob.glob(word, root_dir=REPO)) if "*" in word else []
        argv += matches or [word]
    return environment, argv


@pytest.fixture(scope="module")
def live(checkpoints: Path) -> Iterator[Running]:
    """The README's client commands' server: tiny rope and alibi, a context long enough for
    their 200 tokens."""
    settings = test_settings(checkpoints, models=["rope", "alibi"], max_context=512)
    with running_server(settings) as running:
        yield running


def test_the_readme_has_commands_of_every_kind() -> None:
    starts = {argv_of(command)[1][0] for command in COMMANDS}
    assert {"make", "ordinal", "curl", "docker", ".venv/bin/python", ".venv/bin/torchrun"} <= starts


def check_ordinal(argv: list[str]) -> None:
    """Parsed as written, then the first thing the command does with its arguments."""
    try:
        args = ordinal.build_parser().parse_args(argv)
    except SystemExit as exit_:
        assert exit_.code == 0, f"ordinal rejects {argv}"
        return  # --help
    if args.command == "eval":
        folders = model.evaluate.checkpoint_folders(args.checkpoints)
        assert folders and all((folder / "model.safetensors").is_file() for folder in folders)
    elif args.command == "geometry":
        assert all((REPO / folder / "config.json").is_file() for folder in args.checkpoints)
    elif args.command == "train":
        assert args.scheme in ordinal.SCHEMES
    elif args.command == "serve":
        settings_from_args(args)


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_works_as_written(
    command: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    environment, argv = argv_of(command)
    env = {**os.environ, **environment}
    program = argv[0]
    if program == "make":
        result = subprocess.run(["make", "-n", *argv[1:]], cwd=REPO, env=env, capture_output=True)
        assert result.returncode == 0, result.stderr
        if "PORT=8100" in argv:
            assert b"ordinal serve --port 8100" in result.stdout
    elif program in ("ordinal", ".venv/bin/ordinal") and argv[1] == "COMMAND":
        for name in ordinal.COMMANDS:
            check_ordinal([name, *argv[2:]])
    elif program in ("ordinal", ".venv/bin/ordinal"):
        check_ordinal(argv[1:])
    elif program == ".venv/bin/torchrun":
        assert (REPO / program).is_file() or shutil.which("torchrun")
        module_at = argv.index("-m")
        assert argv[module_at + 1] == "ordinal"
        check_ordinal(argv[module_at + 2 :])
    elif program == ".venv/bin/python" and argv[1] == "clients/stream.py":
        live: Running = request.getfixturevalue("live")
        env["ORDINAL_URL"] = live.url
        result = subprocess.run(
            [sys.executable, *argv[1:]], cwd=REPO, env=env, capture_output=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        assert b"time to first token" in result.stderr
    elif program == ".venv/bin/python" and argv[1] == "-m":
        result = subprocess.run(
            [sys.executable, "-m", argv[2], "--help"], cwd=REPO, capture_output=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
    elif program == "curl":
        live = request.getfixturevalue("live")
        argv = [re.sub(r"^http://127\.0\.0\.1:8000", live.url, word) for word in argv]
        result = subprocess.run(argv, capture_output=True, timeout=60, text=True)
        assert result.returncode == 0 and '"choices"' in result.stdout, result.stdout
    elif program == "docker":
        check_compose(argv[2:], env)
    else:
        pytest.fail(f"no rule for README command {command!r}: add one to tests/test_readme.py")


def check_compose(args: list[str], env: dict[str, str]) -> None:
    """``docker compose ARGS``: each profile named exists, and each service named is in it
    (and every compose tool installed accepts the file with those profiles)."""
    for tool in compose_tools():
        profiles = [word for flag, word in itertools.pairwise(args) if flag == "--profile"]
        options = [item for profile in profiles for item in ("--profile", profile)]
        result = subprocess.run([*tool, *options, "config", "-q"], cwd=REPO, env=env)
        assert result.returncode == 0, tool
    services = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    assert args[0] in ("up", "--profile"), args
    profiles = {word for flag, word in itertools.pairwise(args) if flag == "--profile"}
    named = [word for word in args[args.index("up") + 1 :] if not word.startswith("-")]
    for name in named:
        assert name in services, name
        assert set(services[name].get("profiles", [])) <= profiles, name
    for profile in profiles:
        assert any(profile in service.get("profiles", []) for service in services.values())
