"""``make mutation``: mutation testing of ordinal's core files with mutmut.

    python -m tools.mutation                            # every file of [tool.ordinal.mutation]
    python -m tools.mutation model/positional/rope.py   # only these files
    python -m tools.mutation --report                   # print the last run's report again

pyproject.toml's ``[tool.ordinal.mutation]`` says what is mutated and by which tests it is judged:
each key is a glob of source files (matched as mutmut's ``only_mutate`` matches), its value the
test files to run against them. mutmut's own settings are in ``[tool.mutmut]``.

mutmut has a single test selection per run, so this runs it once per entry of that table, each in
a fresh process with ``only_mutate`` and the test selection set from the entry, one worker unless
``--jobs`` says more. Within an entry mutmut runs, for each mutant, only those of the entry's
tests that call the mutated function. Every run starts from an empty ``mutants/``: mutmut keeps
the verdict of an unchanged function across runs even when the tests have changed.

The report (printed, and kept in mutants/report.txt) gives each file's mutants killed / total and
every mutant that was not killed, with the lines it changed. docs/testing.md keeps the scores and
says which survivors are equivalent (no test can tell them from the original).

This drives mutmut through its internals (its config object, result files and diff helper), so
the dev extra pins mutmut to 3.8.x; a newer mutmut may need this module updated.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = Path("mutants")  # mutmut's working copy, relative to ROOT (mutmut's choice)
REPORT = MUTANTS / "report.txt"
DETECTED = ("killed", "timeout")  # the statuses of a mutant that some test noticed


@dataclasses.dataclass(frozen=True)
class Entry:
    """One run of mutmut: the source files it mutates and the tests that judge them."""

    files: tuple[str, ...]
    tests: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Missed:
    """A mutant no test killed: its mutmut name, status and the lines it changed."""

    name: str
    status: str
    change: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class FileResult:
    path: str
    total: int
    detected: int
    missed: tuple[Missed, ...]


def read_entries(requested: list[str]) -> list[Entry]:
    """The entries of [tool.ordinal.mutation], restricted to ``requested`` files if any."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text()).get("tool", {})
    table = tool.get("ordinal", {}).get("mutation")
    if not table:
        raise SystemExit("pyproject.toml has no [tool.ordinal.mutation] table of files and tests")
    source_paths = tool.get("mutmut", {}).get("source_paths", [])
    # The files mutmut walks, named as it names them (and as only_mutate patterns match them).
    sources = sorted(path.as_posix() for root in source_paths for path in Path(root).rglob("*.py"))
    wanted = {Path(path).resolve().relative_to(ROOT).as_posix() for path in requested}
    entries, claimed = [], {}
    for pattern, tests in table.items():
        package = pattern.split("/")[0]
        if package not in source_paths:
            raise SystemExit(
                f"[tool.ordinal.mutation] {pattern!r}: add {package!r} to [tool.mutmut] "
                f"source_paths (mutmut copies only those into mutants/)"
            )
        files = [path for path in sources if fnmatch.fnmatch(path, pattern)]
        if not files:
            raise SystemExit(f"[tool.ordinal.mutation] {pattern!r} matches no source file")
        absent = [test for test in tests if not (ROOT / test).exists()]
        if absent:
            raise SystemExit(f"[tool.ordinal.mutation] {pattern!r}: no such tests {absent}")
        for path in files:
            if path in claimed:
                raise SystemExit(f"{path} is in two entries: {claimed[path]!r} and {pattern!r}")
            claimed[path] = pattern
        if wanted:
            files = [path for path in files if path in wanted]
        if files:
            entries.append(Entry(tuple(files), tuple(tests)))
    unknown = sorted(wanted - claimed.keys())
    if unknown:
        raise SystemExit(f"not in any entry of [tool.ordinal.mutation]: {unknown}")
    return entries


def run_mutmut(entry: Entry, jobs: int) -> None:
    """``mutmut run`` with the entry's only_mutate and test selection (call in a fresh process)."""
    from mutmut import configuration

    configuration._config = dataclasses.replace(
        configuration.config(),
        only_mutate=list(entry.files),
        pytest_add_cli_args_test_selection=list(entry.tests),
    )
    from mutmut.__main__ import cli

    cli(["run", "--max-children", str(jobs)], prog_name="mutmut")


def run_entry(entry: Entry, jobs: int) -> None:
    # The stats map each test to the functions it calls; they are only valid for the entry
    # whose files were instrumented when they were collected.
    (MUTANTS / "mutmut-stats.json").unlink(missing_ok=True)
    # An earlier entry left plain copies of these files, newer than the sources: mutmut would
    # take them for finished mutants and not mutate them.
    for path in entry.files:
        (MUTANTS / path).unlink(missing_ok=True)
    payload = json.dumps(dataclasses.asdict(entry))
    command = [sys.executable, "-m", "tools.mutation", "--run-mutmut", payload, "--jobs", str(jobs)]
    returncode = subprocess.run(command, check=False).returncode
    if returncode:
        raise SystemExit(f"mutmut failed (exit {returncode}) on {', '.join(entry.files)}")


def collect(entry: Entry) -> list[FileResult]:
    """The verdicts on the entry's files, read before the next entry's run overwrites their
    mutated copies (which the diffs are read from)."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code

    results = []
    for path in entry.files:
        meta = MUTANTS / f"{path}.meta"
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
        statuses = {name: status_by_exit_code[code] for name, code in codes.items()}
        missed = []
        for name, status in statuses.items():
            if status in DETECTED:
                continue
            diff = get_diff_for_mutant(name, path=path).splitlines()
            change = tuple(
                line for line in diff if line[:1] in "-+" and not line.startswith(("---", "+++"))
            )
            missed.append(Missed(name.rpartition(".")[2], status, change))
        detected = sum(status in DETECTED for status in statuses.values())
        results.append(FileResult(path, len(statuses), detected, tuple(missed)))
    return results


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def render(results: list[FileResult], seconds: float, jobs: int) -> str:
    width = max(len(result.path) for result in results)
    total = sum(result.total for result in results)
    detected = sum(result.detected for result in results)
    lines = [
        f"mutmut over {len(results)} files: {total} mutants in {seconds:.0f} s ({jobs} worker"
        f"{'s' if jobs > 1 else ''})",
        "",
        f"{'file':<{width}}  killed  total   score",
    ]
    for result in results:
        lines.append(
            f"{result.path:<{width}}  {result.detected:>6}  {result.total:>5}  "
            f"{percent(result.detected, result.total):>6}"
        )
    lines.append(f"{'all':<{width}}  {detected:>6}  {total:>5}  {percent(detected, total):>6}")
    for result in results:
        if result.missed:
            lines += ["", f"not killed in {result.path}:"]
        for missed in result.missed:
            lines.append(f"  {missed.name} ({missed.status})")
            lines += [f"      {line}" for line in missed.change]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.mutation", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("files", nargs="*", help="source files to mutate (default: all listed)")
    parser.add_argument("--jobs", type=int, default=1, help="mutmut workers (default 1)")
    parser.add_argument("--report", action="store_true", help="print the last run's report")
    parser.add_argument("--run-mutmut", help=argparse.SUPPRESS)  # internal: one entry's run
    args = parser.parse_args(argv)
    os.chdir(ROOT)

    if args.run_mutmut:
        entry = json.loads(args.run_mutmut)
        run_mutmut(Entry(tuple(entry["files"]), tuple(entry["tests"])), args.jobs)
        return
    if args.report:
        if not REPORT.exists():
            raise SystemExit(f"no report yet: {REPORT} is written by a run")
        print(REPORT.read_text(), end="")
        return

    entries = read_entries(args.files)
    shutil.rmtree(MUTANTS, ignore_errors=True)
    start = time.perf_counter()
    results = []
    for entry in entries:
        print(f"== mutmut: {', '.join(entry.files)}\n   tests: {', '.join(entry.tests)}")
        run_entry(entry, args.jobs)
        results += collect(entry)
    report = render(results, time.perf_counter() - start, args.jobs)
    # Imported here, never at the top: the --run-mutmut child runs this module, and a `model`
    # imported before mutmut puts mutants/ first on sys.path would be the unmutated one, so the
    # tests would never reach a mutant (mutmut: "could not find any test case for any mutant").
    from model.files import write_text_atomic

    write_text_atomic(REPORT, report)
    print(f"\n{report}", end="")


if __name__ == "__main__":
    main()
