"""docs/tasks.md and one plot per task, generated from the result files alone.

``render(out)`` is a pure function of the files in ``out``: the results (``TASK-SCHEME.json``)
and the hand-written ``discussion.md`` (what a person concluded after reading the results, and
the comparison with the papers), which is included verbatim so that regenerating the page never
loses it. ``write_report(out)`` writes the page to ``out`` + ``.md`` and the plots into
``out``. A test checks that the committed page is what ``render`` makes of the committed
results.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.figure import Figure

from lab.markdown import markdown_table
from lab.tasks import TASKS, TaskError
from lab.tasks.claims import CLAIMS, FAILS, HOLDS, LEARNED, overall, past_l_retention
from lab.tasks.entries import ENTRIES, describe
from lab.tasks.results import Summary, format_mean, load_results
from lab.tasks.training import DEFAULT_LONGEST, suite_name
from model.files import write_figure_atomic, write_text_atomic

DISCUSSION_FILE = "discussion.md"
FULL_RUN = "ordinal tasks"
DEFAULT_OUT = Path("docs/tasks")
DEFAULT_SEEDS = 3


def summaries(out: Path) -> list[Summary]:
    """Every result in ``out``, summarised; they must share their settings."""
    results = load_results(out)
    if not results:
        raise TaskError(f"no results in {out}: run `ordinal tasks --out {out}` first")
    settings = results[0]["settings"]
    for result in results:
        if result["settings"] != settings:
            raise TaskError(
                f"{out} holds results made with different settings ({result['task']} "
                f"{result['scheme']} differs from {results[0]['task']} {results[0]['scheme']}): "
                "rerun them with --reuse, or remove the stale ones"
            )
    return [Summary.of(result) for result in results]


def write_report(out: Path) -> dict[str, Any]:
    """Write the page (``out`` + ``.md``) and ``out/TASK.png`` for every task with results;
    returns {"results": [Summary], "markdown": str, "figures": [names]}."""
    found = summaries(out)
    figures = []
    for name in _tasks(found):
        figure = plot_task([s for s in found if s.task == name])
        path = out / f"{name}.png"
        write_figure_atomic(path, figure)
        figures.append(path.name)
    markdown = render(out)
    write_text_atomic(out.with_suffix(".md"), markdown)
    return {"results": found, "markdown": markdown, "figures": figures}


def _tasks(found: list[Summary]) -> list[str]:
    return [name for name in TASKS if any(s.task == name for s in found)]


def _schemes(found: list[Summary]) -> list[str]:
    return list(dict.fromkeys(s.scheme for s in found))


def plot_task(found: list[Summary]) -> Figure:
    """Accuracy against test length, one line per scheme, error bars = spread over seeds."""
    figure = Figure(layout="constrained", figsize=(7.5, 4.5))
    axes = figure.subplots()
    length = found[0].length
    tab20 = matplotlib.colormaps["tab20"]  # 20 colours in pairs: strong, then its light one
    palette = [tab20(index) for index in range(tab20.N)]
    for index, summary in enumerate(found):
        tests = sorted(summary.accuracy)
        # Ten strong colours with round markers, then their light pairs, dashed and square:
        # every line tells itself apart from the others (matplotlib's default cycle has ten).
        later = index >= len(palette) // 2
        axes.errorbar(
            tests,
            [summary.mean(t) for t in tests],
            yerr=[summary.spread(t) for t in tests],
            color=palette[(2 * index + later) % len(palette)],
            marker="s" if later else "o",
            linestyle="--" if later else "-",
            capsize=3,
            label=summary.scheme,
        )
    axes.axhline(found[0].chance, color="grey", linestyle="--", label="chance")
    axes.axvline(length, color="grey", linestyle=":", label="trained length L")
    axes.set_xscale("log", base=2)
    tests = sorted(found[0].accuracy)
    axes.set_xticks(tests, [f"{t} ({t // length}L)" for t in tests])
    axes.set_xlim(tests[0] / 1.25, tests[-1] * 1.25)
    axes.set(
        # Wrapped: a long summary centred over the axes would run off the figure's left edge.
        # The summary is markdown for the page; a plot title shows its backticks raw.
        title=textwrap.fill(
            f"{found[0].task}: {TASKS[found[0].task].summary.replace('`', '')}", 64
        ),
        xlabel="test length (tokens)",
        ylabel="accuracy on the answers",
        ylim=(0, 1.02),
    )
    axes.legend(loc="center left", bbox_to_anchor=(1, 0.5), fontsize="small")
    return figure


def render(out: Path) -> str:
    """The whole page, from the results in ``out`` and its discussion.md."""
    found = summaries(out)
    discussion = out / DISCUSSION_FILE
    if discussion.exists():
        written = discussion.read_text().strip()
    else:
        rerun = command(out, found[0].result["settings"]) + " --reuse"
        written = _NO_DISCUSSION.format(discussion=discussion, rerun=rerun)
    sections = [
        _introduction(out, found),
        _task_table(found),
        _accuracy_table(found),
        _figures(out, found),
        _past_l_table(found),
        _claims_table(found),
        "## What the results say\n\n" + written,
    ]
    return "\n\n".join(sections) + "\n"


_NO_DISCUSSION = (
    "*Not written yet: put what the results say about each scheme, and how they compare with "
    "the ALiBi, NoPE, CoPE and FIRE papers, in `{discussion}`, then `{rerun}` (nothing is "
    "retrained) includes it here.*"
)


_NORM_NOTE = {
    "rmsnorm": " (not LayerNorm: it subtracts each vector's mean, which removes integer's "
    "p·(1, …, 1) exactly and would make integer the same model as none)"
}


def command(out: Path, settings: dict[str, Any]) -> str:
    """The ``ordinal tasks`` command line that makes results with ``settings`` into ``out``."""
    words = [FULL_RUN]
    if suite_name(settings) == "quick":
        words.append("--quick")
    if max(settings["multiples"]) != DEFAULT_LONGEST:
        words.append(f"--longest {max(settings['multiples'])}")
    if settings["seeds"] != DEFAULT_SEEDS:
        words.append(f"--seeds {settings['seeds']}")
    if out != DEFAULT_OUT:
        words.append(f"--out {out}")
    return " ".join(words)


def _optimiser(train: dict[str, Any]) -> str:
    """How ``lab.train.build_optimizers`` splits the parameters, in words, with the peaks."""
    if train["optimizer"] == "muon":
        return (
            f"Muon for the blocks' matrices (peak {train['muon_lr']}, momentum "
            f"{train['muon_momentum']}) and AdamW for the rest (peak {train['lr']})"
        )
    return f"AdamW (peak {train['lr']})"


def _introduction(out: Path, found: list[Summary]) -> str:
    settings = found[0].result["settings"]
    model, train = settings["model"], settings["train"]
    length, seeds = settings["length"], settings["seeds"]
    tests = ", ".join(f"{m}L = {m * length}" for m in settings["multiples"])
    positional = "; ".join(
        f"{scheme}: " + ", ".join(f"{key} {value}" for key, value in params.items())
        for scheme, params in settings["positional"].items()
    )
    minutes = sum(s.result["wall_seconds"] for s in found) / 60
    run = command(out, settings)
    lines = [
        "# Length generalisation on tasks where position matters",
        "",
        f"<!-- Generated by `ordinal tasks` (lab/tasks/report.py) from {out}/*.json and "
        f"{out}/{DISCUSSION_FILE}: edit those and rerun with --reuse, not this page. -->",
        "",
        "One tiny model per scheme, task and seed (the same size, data and budget for every "
        "scheme; only the positional encoding differs), trained on sequences of "
        f"L = {length} tokens and tested on new sequences of {tests} tokens. These are the "
        f"results of the {suite_name(settings) or 'custom'} run ({len(found)} (scheme, task) "
        f"results × {seeds} seeds), made and remade by:",
        "",
        "```sh",
        f"{run}            # trains and tests everything, then writes this page and the plots",
        f"{run} --reuse    # retrains only what is missing or was made with other settings",
        "```",
        "",
        f"- **Model**: {_plural(model['n_layers'], 'layer')}, d_model {model['d_model']}, "
        f"{_plural(model['n_heads'], 'head')}, d_ff {model['d_ff']}, {model['norm']}"
        f"{_NORM_NOTE.get(model['norm'], '')}, dropout {model['dropout']}. The schemes' own "
        f"parameters ({positional}) are the shipped checkpoints', but integer's scale: in units "
        "of L, since the raw p swamped the token embeddings and learned nothing at L.",
        f"- **Training**: {train['steps']} steps of {train['batch_size']} fresh sequences of "
        f"length L, with `ordinal train`'s {_optimiser(train)}, warmup "
        f"({train['warmup_steps']} steps) and cosine decay to {train['min_lr'] / train['lr']:g} × "
        f"each peak; the loss counts the answer tokens only. Seed s = 0..{seeds - 1} sets the "
        "initial weights and the training "
        f"sequences; the {settings['test_sequences']} test sequences of each length are the "
        "same for every scheme and seed.",
        "- **Accuracy**: exact match of the greedy prediction on each answer token, predicted "
        "from the true tokens before it; mean ± sample standard deviation over the "
        f"{seeds} seeds. **Chance**: always giving the test set's most common answer.",
        f"- **Tables past L**: learned, mds and lowrank get a table of "
        f"{max(settings['multiples'])}L rows, and training only reaches rows 0..L−2 (a "
        "sequence of L tokens is read as L−1 inputs, each predicting the next), so the later "
        "rows keep their initial values (mds: rows 0..L−1 are P_MDS of the task's training "
        "sequences; lowrank: the rows of A stay as drawn, B is trained). The longer tests "
        "therefore run, and put to the test the seeds' claim that a table cannot serve past its "
        "last trained row, instead of refusing. An answer at position L or later is the first "
        "predicted from an untrained row.",
        f"- **Time**: {minutes:.1f} minutes of training and testing, summed over the results "
        "(the workers of `--jobs` run side by side, so the run itself took less).",
        *_recipes(found, train["steps"]),
        _not_run_yet(found, run),
    ]
    return "\n".join(lines)


def _recipes(found: list[Summary], steps: int) -> list[str]:
    """A line naming the entries that are a scheme with a recipe of its own (prope, drope)."""
    recipes = {s.scheme: s.result["recipe"] for s in found if "recipe" in s.result}
    if not recipes:
        return []
    described = "; ".join(f"{name}: {describe(recipe, steps)}" for name, recipe in recipes.items())
    return [f"- **Entries that are a recipe, not a scheme of their own**: {described}."]


def _not_run_yet(found: list[Summary], run: str) -> str:
    """What the suite has that ``found`` lacks: whole tasks, whole entries, then other pairs."""
    done = {(s.scheme, s.task) for s in found}
    tasks = [name for name in TASKS if not any(s.task == name for s in found)]
    entries = [name for name in ENTRIES if not any(s.scheme == name for s in found)]
    others = [
        (entry, name)
        for name in TASKS
        for entry in ENTRIES
        if (entry, name) not in done and name not in tasks and entry not in entries
    ]
    if not (tasks or entries or others):
        return f"- **Coverage**: every entry ({len(ENTRIES)}) on every task ({len(TASKS)})."
    parts = [
        f"the task{'s' * (len(tasks) > 1)} {', '.join(tasks)}" if tasks else "",
        f"the entr{'ies' if len(entries) > 1 else 'y'} {', '.join(entries)}" if entries else "",
        f"{_plural(len(others), 'other (scheme, task) pair')}" if others else "",
    ]
    missing = " and ".join(part for part in parts if part)
    return (
        f"- **Not run yet**: {missing}: no results here, so no row, column or plot below. "
        f"`{run} --reuse` trains only what is missing."
    )


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _task_table(found: list[Summary]) -> str:
    header = ["task", "what is asked", "vocabulary", "answers per sequence at L", "chance at L"]
    cells = []
    for name in _tasks(found):
        first = next(s for s in found if s.task == name)
        answers = sum(first.result["answers"][str(first.length)])
        per_sequence = answers / first.result["settings"]["test_sequences"]
        task = TASKS[name]
        summary = task.summary.replace("|", "\\|")  # a bare | would end the table cell
        cells.append(
            [name, summary, str(task.vocab_size), f"{per_sequence:.1f}", f"{first.chance:.2f}"]
        )
    return "\n".join(["## The tasks", "", *markdown_table(header, cells)])


def _accuracy_table(found: list[Summary]) -> str:
    names, tests = _tasks(found), sorted(found[0].accuracy)
    length = found[0].length
    header = ["scheme", *(f"{name} {t // length}L" for name in names for t in tests)]
    rows = []
    for scheme in _schemes(found):
        cells = [scheme]
        for name in names:
            summary = _find(found, scheme, name)
            cells += [format_mean(summary, t) if summary else "–" for t in tests]
        rows.append(cells)
    return "\n".join(["## Accuracy", "", *markdown_table(header, rows)])


def _find(found: list[Summary], scheme: str, name: str) -> Summary | None:
    return next((s for s in found if s.scheme == scheme and s.task == name), None)


def _figures(out: Path, found: list[Summary]) -> str:
    images = [f"![{name}]({out.name}/{name}.png)" for name in _tasks(found)]
    return "## Accuracy against test length\n\n" + "\n".join(images)


def _past_l_table(found: list[Summary]) -> str:
    length = found[0].length
    names = [name for name in _tasks(found) if TASKS[name].stationary]
    if not names or 2 * length not in found[0].accuracy:
        return "## Before and past L\n\nNo stationary task was tested at 2L."
    header = ["scheme", *(f"{name} {part}" for name in names for part in ("< L", "≥ L", "kept"))]
    intro = [
        "## Before and past L",
        "",
        f"{' and '.join(names)} are stationary (the first n tokens of a longer sequence are "
        "distributed as a sequence of n tokens), so in their 2L test the answers before "
        f"position L = {length} and past it follow contexts of the same kind, and only the "
        "positions differ: accuracy on each side, and the share of the margin above chance "
        "kept past L (means over seeds).",
        "",
    ]
    rows = []
    for scheme in _schemes(found):
        cells = [scheme]
        for name in names:
            summary = _find(found, scheme, name)
            if summary is None:
                cells += ["–"] * 3
                continue
            before = summary.window(2 * length, 0, length)
            past = summary.window(2 * length, length, 2 * length)
            cells += [_figure(value) for value in (before, past, past_l_retention(summary))]
        rows.append(cells)
    return "\n".join([*intro, *markdown_table(header, rows)])


def _figure(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _claims_table(found: list[Summary]) -> str:
    names = _tasks(found)
    intro = [
        "## The seeds' claims, measured",
        "",
        "Each claim of the seeds, what it predicts these tasks would show, and whether they show "
        f"it, per task. A claim is tested only on the tasks the scheme learned at L (mean "
        f"accuracy at least {LEARNED:g} of the way from chance to 1). *Retention* at a length is "
        "the share of the margin above chance at L that the model keeps there; *past-L "
        "retention* is that share on the answers past L against those before it, in the 2L test "
        f"(the table above); ≥ {HOLDS:g} counts as kept, below {FAILS:g} as lost, between as "
        "partly. Computed by lab/tasks/claims.py from the results.",
        "",
    ]
    header = ["scheme", "claim", "what would show it", *names, "overall"]
    rows = []
    for claim in (claim for claim in CLAIMS if claim.scheme in _schemes(found)):
        summaries_of = [_find(found, claim.scheme, name) for name in names]
        verdicts = [claim.judge(s) for s in summaries_of if s is not None]
        cells = ["–" if s is None else claim.judge(s).cell() for s in summaries_of]
        rows.append([claim.scheme, claim.claim, claim.prediction, *cells, overall(verdicts)])
    return "\n".join([*intro, *markdown_table(header, rows)])
