"""``ordinal tasks``: every (scheme, task) trained and tested over several seeds, then the report.

Each (scheme, task) is one unit of work: its seeds are trained one after another and its result
— the settings, chance, and every seed's correct answers per position at every test length —
is written atomically to ``OUT/TASK-SCHEME.json`` as soon as it is done, so an interrupted run
keeps what it finished and ``--reuse`` skips it next time (a result is reused only when its
settings and seeds are the current ones). Units run in ``--jobs`` worker processes of one
thread each (these models are too small for a second thread to help; a second process keeps
the second core busy). Once every unit is written, docs/tasks.md and the plots are
generated from the result files alone (``lab.tasks.report``). The options are ``ordinal
tasks``'s (ordinal.py restates the defaults here; tests/server/test_cli.py checks them).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from lab.tasks import TASKS, TaskError, task
from lab.tasks.entries import ENTRIES
from lab.tasks.report import DEFAULT_OUT, DEFAULT_SEEDS, write_report
from lab.tasks.results import load_results, result_path
from lab.tasks.training import (
    DEFAULT_LONGEST,
    LONGEST,
    SUITES,
    SuiteSettings,
    evaluation_batch,
    majority_accuracy,
    run_seed,
)
from model.files import write_json_atomic

DEFAULT_JOBS = 2


def _names(text: str | None, valid: list[str], kind: str) -> list[str]:
    """A comma-separated list of names (None: all of ``valid``), each checked."""
    if text is None:
        return list(valid)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in valid]
    if unknown or not names:
        raise TaskError(f"unknown {kind} {unknown or [text]}; valid: {valid}")
    return names


def run_unit(scheme: str, task_name: str, seeds: int, settings: SuiteSettings) -> dict[str, Any]:
    """Train and test entry ``scheme`` (``lab.tasks.entries``) on ``task_name`` for seeds
    0..seeds−1 → the result to save (with the entry's recipe, where it has one of its own)."""
    torch.set_num_threads(1)
    chosen = task(task_name)
    started = time.perf_counter()
    runs = [run_seed(scheme, chosen, seed, settings) for seed in range(seeds)]
    tests = {
        length: evaluation_batch(chosen, length, settings.test_sequences)
        for length in settings.test_lengths
    }
    recipe = ENTRIES[scheme].recipe()
    return {
        "scheme": scheme,
        "task": task_name,
        **({"recipe": recipe} if recipe is not None else {}),
        "settings": {**settings.to_dict(), "seeds": seeds},
        "chance": {str(length): majority_accuracy(batch) for length, batch in tests.items()},
        "answers": {
            str(length): batch.answers.sum(dim=0).tolist() for length, batch in tests.items()
        },
        "correct": runs,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }


def _reusable(path: Path, settings: dict[str, Any], scheme: str) -> bool:
    """Whether ``path`` holds a result made with ``settings`` (its seeds included) and entry
    ``scheme``'s current recipe."""
    try:
        result = json.loads(path.read_text())
        return result["settings"] == settings and result.get("recipe") == ENTRIES[scheme].recipe()
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _refuse_a_mixed_folder(
    out: Path, units: list[tuple[str, str]], settings: dict[str, Any]
) -> None:
    """The page is made from every result in ``out``, so they must share their settings: a
    result this run will not rewrite must already have ``settings`` (checked before training)."""
    for result in load_results(out) if out.is_dir() else []:
        if (result["scheme"], result["task"]) not in units and result["settings"] != settings:
            raise TaskError(
                f"{out} holds {result['task']}-{result['scheme']}.json made with other settings: "
                "rerun every scheme and task with these settings, or use another --out"
            )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``ordinal tasks`` per ``args``; returns the report (see lab.tasks.report)."""
    longest = getattr(args, "longest", DEFAULT_LONGEST)
    if longest not in LONGEST:
        raise TaskError(f"--longest must be one of {list(LONGEST)}, got {longest}")
    settings = SUITES["quick" if args.quick else "full"].up_to(longest)
    schemes = _names(args.schemes, list(ENTRIES), "scheme(s)")
    task_names = _names(args.tasks, list(TASKS), "task(s)")
    if args.seeds < 1 or args.jobs < 1:
        raise TaskError(f"--seeds and --jobs must be ≥ 1, got {args.seeds} and {args.jobs}")
    for name in task_names:  # refuse a test length a task cannot make before training anything
        for length in settings.test_lengths:
            task(name).generate(0, length, 1)
    wanted = {**settings.to_dict(), "seeds": args.seeds}
    units = [(scheme, name) for name in task_names for scheme in schemes]
    _refuse_a_mixed_folder(args.out, units, wanted)
    if args.reuse:
        units = [
            (scheme, name)
            for scheme, name in units
            if not _reusable(result_path(args.out, scheme, name), wanted, scheme)
        ]
    progress = tqdm(
        total=len(units), desc="tasks", unit="model set", disable=not units, leave=False
    )
    if args.jobs == 1 or len(units) <= 1:
        for scheme, name in units:
            _save(args.out, run_unit(scheme, name, args.seeds, settings), progress)
    else:
        context = multiprocessing.get_context("spawn")  # no forked copy of torch's thread pools
        with ProcessPoolExecutor(min(args.jobs, len(units)), mp_context=context) as pool:
            futures = [
                pool.submit(run_unit, scheme, name, args.seeds, settings) for scheme, name in units
            ]
            for future in as_completed(futures):
                _save(args.out, future.result(), progress)
    progress.close()
    report = write_report(args.out)
    print(f"wrote {len(report['results'])} results in {args.out} and {args.out.with_suffix('.md')}")
    return report


def _save(out: Path, result: dict[str, Any], progress: tqdm) -> None:
    write_json_atomic(result_path(out, result["scheme"], result["task"]), result)
    progress.set_postfix_str(f"{result['scheme']} {result['task']} {result['wall_seconds']} s")
    progress.update()


__all__ = [
    "DEFAULT_JOBS",
    "DEFAULT_LONGEST",
    "DEFAULT_OUT",
    "DEFAULT_SEEDS",
    "LONGEST",
    "run",
    "run_unit",
]
