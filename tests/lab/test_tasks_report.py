"""``ordinal tasks`` end to end (the --quick budget), the page generated from the results alone,
and the seeds' claims judged from made-up results whose answer is known."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ordinal
from lab.tasks import TASKS, claims, suite, training
from lab.tasks.claims import CLAIMS, NOT_SUPPORTED, PARTLY, SUPPORTED
from lab.tasks.entries import ENTRIES
from lab.tasks.report import DISCUSSION_FILE, render
from lab.tasks.results import Summary, load_results
from lab.tasks.training import SUITES
from model.positional import SCHEMES
from ordinal import main

REPO = Path(__file__).resolve().parents[2]
COMMITTED = Path("docs/tasks")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The whole --quick pipeline, once for this module: every scheme and task, 2 seeds (a
    mean and a spread; the third of the default only costs time here)."""
    out = tmp_path_factory.mktemp("quick") / "tasks"
    assert main(["tasks", "--quick", "--jobs", "1", "--seeds", "2", "--out", str(out)]) == 0
    return out


def test_quick_writes_a_result_per_scheme_and_task_a_plot_per_task_and_the_page(
    quick_run: Path,
) -> None:
    results = load_results(quick_run)
    assert len(results) == len(ENTRIES) * len(TASKS)
    for result in results:
        assert len(result["correct"]) == 2
        assert set(result["answers"]) == {str(t) for t in SUITES["quick"].test_lengths}
    for name in TASKS:
        assert (quick_run / f"{name}.png").read_bytes().startswith(b"\x89PNG")
    page = quick_run.with_suffix(".md").read_text()
    assert page == render(quick_run)
    assert "ordinal tasks --quick" in page and "## The seeds' claims, measured" in page


def test_reuse_trains_nothing_and_keeps_the_hand_written_discussion(
    quick_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "tasks"
    shutil.copytree(quick_run, out)
    (out / DISCUSSION_FILE).write_text("Alibi holds; *rope* does not.\n")

    def must_not_train(*args: object) -> None:
        raise AssertionError("--reuse retrained a result made with the same settings")

    monkeypatch.setattr(suite, "run_unit", must_not_train)
    args = ["tasks", "--quick", "--jobs", "1", "--seeds", "2", "--reuse", "--out", str(out)]
    assert main(args) == 0
    page = out.with_suffix(".md").read_text()
    assert "Alibi holds; *rope* does not." in page
    assert page == render(out)


def test_reuse_retrains_a_result_made_with_other_settings(quick_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "tasks"
    out.mkdir()
    shutil.copy(quick_run / "flipflop-rope.json", out)
    args = ["tasks", "--quick", "--jobs", "1", "--reuse", "--seeds", "3", "--out", str(out)]
    assert main([*args, "--schemes", "rope", "--tasks", "flipflop"]) == 0
    assert len(json.loads((out / "flipflop-rope.json").read_text())["correct"]) == 3
    assert "× 3 seeds" in out.with_suffix(".md").read_text()


def test_a_folder_of_mixed_settings_is_refused_before_training(
    quick_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tasks"
    shutil.copytree(quick_run, out)
    before = (out / "flipflop-rope.json").read_text()
    args = ["tasks", "--quick", "--seeds", "3", "--schemes", "rope", "--tasks", "flipflop"]
    assert main([*args, "--out", str(out)]) == 2
    assert (out / "flipflop-rope.json").read_text() == before
    err = capsys.readouterr().err
    assert err.startswith("ordinal tasks: error: ") and err.count("\n") == 1
    assert "other settings" in err


def test_results_do_not_depend_on_the_number_of_workers(quick_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "tasks"
    assert (
        main(
            [
                "tasks",
                "--quick",
                "--schemes",
                "rope,learned",
                "--tasks",
                "copy",
                "--jobs",
                "2",
                "--seeds",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    for scheme in ("rope", "learned"):
        parallel = json.loads((out / f"copy-{scheme}.json").read_text())
        alone = json.loads((quick_run / f"copy-{scheme}.json").read_text())
        assert parallel["correct"] == alone["correct"] and parallel["chance"] == alone["chance"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--schemes", "rope,nope"], "'nope'"),
        (["--tasks", "sorting"], "'sorting'"),
        (["--seeds", "0"], "--seeds"),
    ],
)
def test_bad_options_are_one_line_errors(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tasks", "--quick", "--out", str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ordinal tasks: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_every_scheme_is_an_entry_and_ordinal_lists_the_entries_and_longest_tests() -> None:
    assert set(SCHEMES) <= set(ENTRIES)
    assert tuple(ENTRIES) == ordinal.TASK_ENTRIES
    assert training.LONGEST == ordinal.TASK_LONGEST
    assert ordinal.TASK_LONGEST[0] == training.DEFAULT_LONGEST


def test_prope_is_rope_keeping_three_quarters_of_its_frequencies() -> None:
    config = training.model_config("prope", TASKS["copy"], SUITES["quick"])
    assert config.positional == {"scheme": "rope", "fraction": 0.75}
    assert training.model_config("rope", TASKS["copy"], SUITES["quick"]).positional == {
        "scheme": "rope"
    }


def test_drope_is_the_rope_model_continued_as_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its first phase is exactly rope's run; then the same weights under none train on for
    the recalibration steps, on the batches after the first phase's."""
    settings, task = SUITES["quick"], TASKS["flipflop"]
    first_phases: list[dict[str, Any]] = []
    steps: list[tuple[int, int]] = []
    copy, optimise = training.copy_weights_but_positional, training.optimise

    def recording_copy(model: Any, source: Any, what: str) -> None:
        first_phases.append({k: v.clone() for k, v in source.state_dict().items()})
        copy(model, source, what)

    def recording_optimise(model: Any, task: Any, seed: int, s: Any, recipe: Any, first_step: int):
        steps.append((first_step, recipe.steps))
        optimise(model, task, seed, s, recipe, first_step)

    monkeypatch.setattr(training, "copy_weights_but_positional", recording_copy)
    monkeypatch.setattr(training, "optimise", recording_optimise)
    drope = training.train_model("drope", task, 0, settings)
    assert drope.config.positional == {"scheme": "none"}
    recalibration = max(1, round(ENTRIES["drope"].recalibration * settings.train.steps))
    assert steps == [(0, settings.train.steps), (settings.train.steps, recalibration)]
    rope = training.train_model("rope", task, 0, settings).state_dict()
    assert rope.keys() == first_phases[0].keys()
    assert all(torch.equal(rope[name], first_phases[0][name]) for name in rope)
    changed = drope.state_dict()
    assert any(not torch.equal(changed[name], rope[name]) for name in changed)


def test_the_recipes_are_recorded_and_a_changed_recipe_is_retrained(
    quick_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drope = json.loads((quick_run / "flipflop-drope.json").read_text())
    assert drope["recipe"] == ENTRIES["drope"].recipe()
    assert drope["recipe"]["continued_as"] == "none"
    assert "recipe" not in json.loads((quick_run / "flipflop-rope.json").read_text())
    page = quick_run.with_suffix(".md").read_text()
    assert "drope: rope for 4 steps, then continued as none" in page
    assert "prope: rope with fraction 0.75" in page
    assert "Not run yet" not in page and "every entry" in page

    out = tmp_path / "tasks"
    out.mkdir()
    for name in ("flipflop-drope.json", "flipflop-rope.json"):
        shutil.copy(quick_run / name, out)
    monkeypatch.setitem(ENTRIES, "drope", dataclasses.replace(ENTRIES["drope"], recalibration=0.5))
    args = ["tasks", "--quick", "--jobs", "1", "--seeds", "2", "--reuse", "--tasks", "flipflop"]
    assert main([*args, "--out", str(out), "--schemes", "rope,drope"]) == 0
    assert json.loads((out / "flipflop-drope.json").read_text())["recipe"]["recalibration"] == 0.5
    assert json.loads((out / "flipflop-rope.json").read_text()) == json.loads(
        (quick_run / "flipflop-rope.json").read_text()
    )


def test_a_partial_run_says_what_is_not_run_yet_and_8l_is_on_request(tmp_path: Path) -> None:
    out = tmp_path / "tasks"
    args = ["tasks", "--quick", "--jobs", "1", "--seeds", "1", "--longest", "8"]
    assert main([*args, "--schemes", "cope,prope", "--tasks", "longcount", "--out", str(out)]) == 0
    results = load_results(out)
    length = SUITES["quick"].length
    assert all(set(r["answers"]) == {str(m * length) for m in (1, 2, 4, 8)} for r in results)
    page = out.with_suffix(".md").read_text()
    assert page == render(out)
    assert "--longest 8 --seeds 1" in page and "longcount 8L" in page
    missing = [name for name in TASKS if name != "longcount"]
    assert f"the tasks {', '.join(missing)}" in page
    not_run = ", ".join(name for name in ENTRIES if name not in ("cope", "prope"))
    assert f"the entries {not_run}:" in page
    assert "quick run" in page  # still the quick suite, at 8L


def test_the_committed_page_is_what_its_results_make(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    if not COMMITTED.with_suffix(".md").exists():
        pytest.skip("docs/tasks.md is not committed yet (`ordinal tasks` writes it)")
    assert COMMITTED.with_suffix(".md").read_text() == render(COMMITTED)


# ------------------------------------------------------------------ claims, on made-up results

LENGTH, CHANCE, ANSWERS = 8, 0.5, 100


def made_up(scheme: str, accuracy: Callable[[int, int], float], task: str = "flipflop") -> Summary:
    """A result whose accuracy at each (test length, position) is ``accuracy``."""
    tests = [m * LENGTH for m in (1, 2, 4)]
    correct = {str(t): [0] + [round(ANSWERS * accuracy(t, p)) for p in range(1, t)] for t in tests}
    result: dict[str, Any] = {
        "scheme": scheme,
        "task": task,
        "settings": {"length": LENGTH, "multiples": [1, 2, 4], "seeds": 2},
        "chance": {str(t): CHANCE for t in tests},
        "answers": {str(t): [0] + [ANSWERS] * (t - 1) for t in tests},
        "correct": [correct, correct],
        "wall_seconds": 0.0,
    }
    return Summary.of(result)


def judge(scheme: str, accuracy: Callable[[int, int], float], task: str = "flipflop") -> str:
    claim = next(c for c in CLAIMS if c.scheme == scheme)
    return claim.judge(made_up(scheme, accuracy, task)).outcome


def perfect(test: int, position: int) -> float:
    return 1.0


def lost_past_l(test: int, position: int) -> float:
    return 1.0 if position < LENGTH else CHANCE


def fading(test: int, position: int) -> float:  # loses its margin linearly over 3L past L
    return max(CHANCE, 1.0 - CHANCE * max(0, position - LENGTH) / (3 * LENGTH))


def test_a_task_that_is_not_stationary_is_judged_by_its_whole_longer_tests() -> None:
    assert judge("learned", lost_past_l, task="copy") == SUPPORTED  # its 2L answers: all past L
    assert judge("learned", perfect, task="copy") == NOT_SUPPORTED
    assert judge("rope", perfect, task="copy") == "n/a"  # before and past L do not compare
    assert judge("binary", lost_past_l, task="copy") == "n/a"


@pytest.mark.parametrize(
    ("scheme", "accuracy", "outcome"),
    [
        ("integer", lost_past_l, SUPPORTED),
        ("integer", perfect, NOT_SUPPORTED),
        ("alibi", perfect, SUPPORTED),
        ("alibi", lost_past_l, NOT_SUPPORTED),
        ("alibi", fading, PARTLY),
        ("learned", lost_past_l, SUPPORTED),
        ("learned", perfect, NOT_SUPPORTED),
        ("rope", perfect, SUPPORTED),
        ("rope", lost_past_l, NOT_SUPPORTED),
        ("binary", lost_past_l, SUPPORTED),
        ("binary", fading, NOT_SUPPORTED),
        ("sinusoidal", perfect, SUPPORTED),
    ],
)
def test_each_claim_is_judged_by_what_it_predicts(
    scheme: str, accuracy: Callable[[int, int], float], outcome: str
) -> None:
    assert judge(scheme, accuracy) == outcome


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: c.scheme)
def test_no_claim_is_judged_on_a_task_the_scheme_did_not_learn(claim: claims.Claim) -> None:
    verdict = claim.judge(made_up(claim.scheme, lambda test, position: 0.6))
    assert verdict.outcome == "n/a" and "not learned" in verdict.evidence


def test_overall_counts_only_the_tasks_tested() -> None:
    verdicts = [
        claims.Verdict(SUPPORTED, ""),
        claims.Verdict("n/a", ""),
        claims.Verdict(PARTLY, ""),
    ]
    assert claims.overall(verdicts) == "supported on 1, partly on 1 of 2 tasks tested"
    assert claims.overall([claims.Verdict("n/a", "")]) == "not tested"
