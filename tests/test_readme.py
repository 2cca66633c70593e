"""Every command in README.md works as written, and so does every command of the pages it sends
a reader to for them (docs/guide.md, docs/api.md).

The commands are the lines of its ``sh`` blocks, the Commands table, and inline ``make …`` and
``… --help`` spans. Each kind is checked by the quickest run that proves it: ``make`` as a dry run
(``make -n``), ``ordinal`` parsed by the real parser (globs expanded, the table's placeholders
filled in) and then checked the way the command starts (eval's folders, serve's settings; an
export runs, and an import of what a README export writes runs after it and must give its
checkpoint back), the client and ``curl`` sent to a live server of tiny checkpoints, ``docker
compose`` by the compose tool when there is one (else its services and profiles), and any other
module by its ``--help``.
A command of a new kind fails here until it gets a rule. The commands of the sections "Your own
text" and "Bring a model" run for real instead, in order, in a folder holding what they name: a
corpus of the user's (notes.jsonl) and tiny Hugging Face folders built locally (gpt2,
SmolLM2-135M).
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

import interop.hf_export
import interop.hf_import
import lab.evaluate
import ordinal
from model.checkpoint import data_section
from model.config import ModelConfig
from model.positional import SCHEMES
from server.api.app import settings_from_args
from tests.server.conftest import Running, running_server, test_settings
from tests.test_deploy import compose_tools

REPO = Path(__file__).resolve().parents[1]
# The README and its pages of commands, read as one text (sections are found in either).
README = "\n".join(
    (REPO / name).read_text() for name in ("README.md", "docs/guide.md", "docs/api.md")
)
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


def sh_commands(text: str) -> list[str]:
    """The commands of the ``sh`` blocks of ``text``."""
    return [
        line
        for block in re.findall(r"```sh\n(.*?)```", text, flags=re.S)
        for line in shell_lines(block)
    ]


def section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


# Sections whose commands run for real (test_readme_section_runs_as_written).
RUN_SECTIONS = {title: sh_commands(section(title)) for title in ("Your own text", "Bring a model")}


def readme_commands() -> list[str]:
    commands = sh_commands(README)
    table = README.split("## Commands", 1)[1].split("\n## ", 1)[0]
    commands += re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)
    for span in re.findall(r"`([^`\n]+)`", README):
        if span.startswith("make ") or (span.startswith("ordinal ") and span.endswith("--help")):
            commands.append(span)
    return list(dict.fromkeys(commands))


RUN_COMMANDS = set(itertools.chain.from_iterable(RUN_SECTIONS.values()))
COMMANDS = [command for command in readme_commands() if command not in RUN_COMMANDS]


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


def test_the_readme_counts_and_tables_every_scheme_and_shipped_recipe() -> None:
    """The README's headline counts and its scheme table follow the registry and the shipped
    checkpoints: a new scheme or recipe fails here until the README says so."""
    own = (REPO / "README.md").read_text()
    shipped = {path.parent.name for path in (REPO / "checkpoints").glob("*/config.json")}
    recipes = shipped - set(SCHEMES)
    opening = own.split("\n## ", 1)[0]
    assert f"any of {len(SCHEMES)} positional schemes" in opening
    assert f"{len(shipped)} checkpoints" in opening and f"the {len(shipped)} shipped" in own
    rows = re.findall(r"^\| `([a-z0-9]+)`", section("The schemes"), flags=re.M)
    assert rows[: len(SCHEMES)] == list(SCHEMES)  # the registry's order
    assert sorted(rows[len(SCHEMES) :]) == sorted(recipes)


def test_the_readme_has_commands_of_every_kind() -> None:
    starts = {argv_of(command)[1][0] for command in COMMANDS}
    assert {"make", "ordinal", "curl", "docker", ".venv/bin/python", ".venv/bin/torchrun"} <= starts


def readme_exports() -> dict[str, list[str]]:
    """The OUT of each README ``ordinal export`` command → the command's arguments."""
    exports = {}
    for command in COMMANDS:
        argv = argv_of(command)[1]
        if argv[:2] == ["ordinal", "export"]:
            exports[str(ordinal.build_parser().parse_args(argv[1:]).out)] = argv[1:]
    return exports


def exported_paths() -> dict[str, str]:
    """The OUT of each README ``ordinal export`` command → its --format (hf or gguf)."""
    parse = ordinal.build_parser().parse_args
    return {out: parse(argv).format for out, argv in readme_exports().items()}


def check_ordinal(argv: list[str], tmp_path: Path | None = None) -> None:
    """Parsed as written, then the first thing the command does with its arguments (an export
    runs, into ``tmp_path``)."""
    try:
        args = ordinal.build_parser().parse_args(argv)
    except SystemExit as exit_:
        assert exit_.code == 0, f"ordinal rejects {argv}"
        return  # --help
    if args.command == "eval":
        folders = lab.evaluate.checkpoint_folders(args.checkpoints)
        assert folders and all((folder / "model.safetensors").is_file() for folder in folders)
    elif args.command == "geometry":
        assert all((REPO / folder / "config.json").is_file() for folder in args.checkpoints)
    elif args.command == "train":
        assert args.scheme in ordinal.SCHEMES
    elif args.command == "serve":
        settings_from_args(args)
    elif args.command == "export":
        assert tmp_path is not None
        args.checkpoint, args.out = REPO / args.checkpoint, tmp_path / args.out.name
        interop.hf_export.run(args)
        assert args.out.exists()
    elif args.command == "import" and args.source in readme_exports():
        # An import of what a README export writes: that export first, then the import, which
        # must give the exported checkpoint again.
        assert tmp_path is not None
        export = ordinal.build_parser().parse_args(readme_exports()[args.source])
        check_ordinal(readme_exports()[args.source], tmp_path)
        args.source, args.out = str(tmp_path / export.out.name), tmp_path / args.out.name
        interop.hf_import.run(args)
        exported_from = REPO / export.checkpoint
        assert ModelConfig.load(args.out / "config.json") == ModelConfig.load(
            exported_from / "config.json"
        )
        weights = [folder / "model.safetensors" for folder in (exported_from, args.out)]
        assert data_section(weights[0].read_bytes()) == data_section(weights[1].read_bytes())


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
        check_ordinal(argv[1:], tmp_path)
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
    elif program in ("vllm", "llama-server"):
        check_peer(argv)
    else:
        pytest.fail(f"no rule for README command {command!r}: add one to tests/test_readme.py")


def check_peer(argv: list[str]) -> None:
    """vLLM or llama.cpp serving what a README export writes (a folder for vLLM, a GGUF file
    for llama.cpp); where the engine is installed, it accepts every flag given."""
    exports = exported_paths()
    if argv[0] == "vllm":
        assert argv[1] == "serve" and exports.get(argv[2]) == "hf", argv
        flags = [word for word in argv[3:] if word.startswith("--")]
        subcommand = ["serve"]
    else:
        assert exports.get(argv[argv.index("-m") + 1]) == "gguf", argv
        flags = [word for word in argv[1:] if word.startswith("-")]
        subcommand = []
    tool = shutil.which(argv[0])
    if tool:
        help_text = subprocess.run(
            [tool, *subcommand, "--help"],
            capture_output=True,
            text=True,
            timeout=300,
        ).stdout
        assert all(flag in help_text for flag in flags), flags


def build_workplace(folder: Path) -> None:
    """What the run sections name: a user's corpus of 200 short documents (not Shakespeare) and
    tiny Hugging Face folders in place of the downloaded ones."""
    from tests.interop.hf_models import gpt2, llama

    words = ["the", "cat", "sat", "on", "a", "mat", "and", "saw", "two", "birds", "fly", "high"]
    rng = random.Random(0)
    texts = ["\n".join(" ".join(rng.choices(words, k=9)) for _ in range(3)) for _ in range(200)]
    lines = [json.dumps({"text": text}) for text in texts]
    (folder / "notes.jsonl").write_text("\n".join(lines) + "\n")
    gpt2(folder / "gpt2")
    llama(folder / "SmolLM2-135M", tie=True)


@pytest.mark.parametrize("title", RUN_SECTIONS)
def test_readme_section_runs_as_written(
    title: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each command of the section, as written, in a folder of tiny stand-ins: ``ordinal``
    commands run (``serve`` as a live server of the folder it names), ``curl`` is sent to it."""
    build_workplace(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert RUN_SECTIONS[title]
    with contextlib.ExitStack() as stack:
        live: Running | None = None
        for command in RUN_SECTIONS[title]:
            _, argv = argv_of(command)
            if argv[:2] == ["ordinal", "serve"]:
                settings = settings_from_args(ordinal.build_parser().parse_args(argv[1:]))
                folder = tmp_path / settings.checkpoints
                live = stack.enter_context(running_server(test_settings(folder)))
            elif argv[0] == "ordinal":
                assert ordinal.main(argv[1:]) == 0, command
            elif argv[0] == "curl":
                assert live is not None, f"{command!r} comes before the section's serve"
                argv = [re.sub(r"^http://127\.0\.0\.1:8000", live.url, word) for word in argv]
                result = subprocess.run(argv, capture_output=True, timeout=60, text=True)
                assert result.returncode == 0 and '"choices"' in result.stdout, result.stdout
            else:
                pytest.fail(f"no rule for {command!r} in the section {title!r}")


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


def test_the_speed_table_is_the_kept_peers_results() -> None:
    """The README's speed table repeats ``bench.peers --load``'s kept medians
    (bench/results/<class>/peers.json; the AVX2 run is the AVX2 code forced on the same AMD
    EPYC): each ordinal figure is its variant's run, and each peer's range spans its two runs,
    so a new run that is not copied in fails here."""
    runs = {
        isa: json.loads((REPO / "bench/results" / isa / "peers.json").read_text())
        for isa in ("avx512", "avx2-on-avx512")
    }
    text = (REPO / "README.md").read_text()
    for run in runs.values():
        assert run["cpu"] == "AMD EPYC with AVX-512" and run["cpu"].split(" with")[0] in text
    for label in ("1 stream × 256", "32 streams × 128", "64 streams × 128"):

        def rate(isa: str, engine: str, label: str = label) -> int:
            return round(runs[isa]["medians"][label][engine]["tokens_per_s"])

        cells = [f"{rate('avx512', 'ordinal'):,}", f"{rate('avx2-on-avx512', 'ordinal'):,}"]
        for engine in ("llama.cpp", "vllm"):
            low, high = sorted(rate(isa, engine) for isa in runs)
            cells.append(f"{low:,}–{high:,}")
        assert f"| {label} | {' | '.join(cells)} |" in text
