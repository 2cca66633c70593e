"""The checkpoints shipped in ./checkpoints: one per scheme, loadable, generating text, small.

A missing checkpoint fails these tests (it is not skipped): one per registered scheme, named after
it, and two recipes on a scheme of the registry (``RECIPES``: p-RoPE and DroPE, issue #25,
checkpoints/README.md), all but ``NOT_TRAINED_YET``: registered schemes whose checkpoints are
still to be trained, which join the shipped ones when they are (the test says so).
Each model's next-token logits for one prompt are pinned in ``tests/data/shipped_logits.json``;
after a deliberate change to the weights or to the model code, rewrite it with
``python -m tests.test_shipped_checkpoints --update`` (and say why in the commit).
"""

from __future__ import annotations

import argparse
import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from model.checkpoint import WEIGHTS_FILE, check_weights, load_checkpoint
from model.generate import generate
from model.positional import SCHEMES
from model.tokenizer import encode_prompt

SHIPPED = Path(__file__).resolve().parent.parent / "checkpoints"
# The first round: the ten schemes of the design card, each exported exactly (model/interop).
SHIPPED_SCHEMES = (
    "none",
    "integer",
    "binary",
    "sinusoidal",
    "learned",
    "rope",
    "alibi",
    "t5",
    "mds",
    "lowrank",
)
# The second round (issue #25): the new schemes trained so far, and two recipes, folder → scheme.
SECOND_ROUND_SCHEMES = ("fox", "fire", "cope")
RECIPES = {"prope": "rope", "drope": "none"}
# The third round (issue #53): the schemes trained; PaTH-FoX, a composition the issue asks for
# but not a shipped model, is exported and checked from a tiny checkpoint (tests/interop).
THIRD_ROUND_SCHEMES = ("irope", "stickbreaking", "pope", "path")
NOT_TRAINED_YET: tuple[str, ...] = ("pathfox",)
# Every shipped checkpoint, folder name → the scheme its config names.
SHIPPED_MODELS = {
    **{name: name for name in SHIPPED_SCHEMES + SECOND_ROUND_SCHEMES + THIRD_ROUND_SCHEMES},
    **RECIPES,
}
SIZE_LIMIT_BYTES = 60 * 10**6  # issue #53: every checkpoint together
HALF_PRECISION = {"BF16", "F16"}

REFERENCE_LOGITS = Path(__file__).resolve().parent / "data" / "shipped_logits.json"
PROMPT = "ROMEO:\nO, "
TOP = 20
STRIDE = 128  # every 128th logit of the vocabulary is pinned too, not only the top ones
# float32 on CPU: a different thread count moves these logits (|x| < 30) by ~1e-6; a change to
# the model's arithmetic (another GELU, another softmax scale, a wrong position) by far more.
ATOL = 1e-4


def test_one_checkpoint_per_scheme_and_recipe() -> None:
    shipped = set(SHIPPED_SCHEMES) | set(SECOND_ROUND_SCHEMES) | set(THIRD_ROUND_SCHEMES)
    assert shipped | set(NOT_TRAINED_YET) == set(SCHEMES) and not shipped & set(NOT_TRAINED_YET)
    assert set(RECIPES.values()) <= set(SCHEMES) and not set(RECIPES) & set(SCHEMES)
    folders = {path.name for path in SHIPPED.iterdir() if path.is_dir()}
    assert not folders & set(NOT_TRAINED_YET), "it is trained: move it to the shipped ones"
    assert folders == set(SHIPPED_MODELS), "a checkpoint folder is missing or not tested"
    # `make checkpoints` rebuilds every one: its SCHEMES are the shipped schemes, in order
    makefile = (SHIPPED.parent / "Makefile").read_text().replace("\\\n", " ")
    (line,) = [line for line in makefile.splitlines() if line.startswith("SCHEMES :=")]
    assert line.split(":=")[1].split() == [name for name in SCHEMES if name in shipped]


@pytest.mark.parametrize(("name", "scheme"), SHIPPED_MODELS.items())
def test_shipped_checkpoint_loads_and_generates(name: str, scheme: str) -> None:
    model, tokenizer = load_checkpoint(SHIPPED / name, device="cpu")
    assert model.config.positional["scheme"] == scheme
    assert model.config.dtype in ("bfloat16", "float16")
    with safe_open(SHIPPED / name / WEIGHTS_FILE, framework="pt") as weights:
        stored = {weights.get_slice(name).get_dtype() for name in weights.keys()}  # noqa: SIM118
    assert stored <= HALF_PRECISION, stored

    (completion,) = generate(model, tokenizer, ["ROMEO:"], max_new_tokens=20)
    assert completion.text.strip(), completion


def test_the_recipes_are_what_their_names_say() -> None:
    """prope is rope keeping 75% of its frequencies; drope is the shipped rope checkpoint's
    weights, recalibrated without positions, and says so in its metrics."""
    prope = json.loads((SHIPPED / "prope" / "config.json").read_text())
    assert prope["positional"] == {"scheme": "rope", "fraction": 0.75}
    drope = json.loads((SHIPPED / "drope" / "metrics.json").read_text())
    rope_config = load_checkpoint(SHIPPED / "rope", device="cpu").model.config
    assert drope["init"]["scheme"] == "rope" and drope["init"]["checkpoint"] == "checkpoints/rope"
    assert drope["init"]["sha256"] == check_weights(SHIPPED / "rope" / WEIGHTS_FILE, rope_config)


def next_token_logits(name: str) -> tuple[list[int], torch.Tensor]:
    """PROMPT's token ids and the float32 CPU logits after them [vocab], as float64."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a shipped checkpoint carries its checksum
        model, tokenizer = load_checkpoint(SHIPPED / name, device="cpu", dtype="float32")
    ids = encode_prompt(tokenizer, PROMPT)
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), last_only=True)[0]
    return ids, logits.double()


def summary_statistics(logits: torch.Tensor) -> list[float]:
    return [logits.mean().item(), logits.std().item(), torch.logsumexp(logits, 0).item()]


def fingerprint(ids: list[int], logits: torch.Tensor) -> dict[str, list]:
    """What the reference file keeps of one model's logits."""
    top = torch.topk(logits, TOP)

    def rounded(values: torch.Tensor | list[float]) -> list[float]:
        return [round(float(value), 6) for value in values]

    return {
        "prompt_ids": ids,
        "top_ids": top.indices.tolist(),
        "top_logits": rounded(top.values),
        f"every_{STRIDE}th": rounded(logits[::STRIDE]),
        "mean_std_logsumexp": rounded(summary_statistics(logits)),
    }


@pytest.mark.parametrize("name", SHIPPED_MODELS)
def test_shipped_logits_match_the_reference(name: str) -> None:
    reference = json.loads(REFERENCE_LOGITS.read_text())["schemes"][name]
    ids, logits = next_token_logits(name)
    assert ids == reference["prompt_ids"], "the tokenizer encodes the prompt differently"

    def close(actual: torch.Tensor | list[float], expected: list[float], what: str) -> None:
        actual = torch.as_tensor(actual, dtype=torch.float64)
        expected = torch.tensor(expected, dtype=torch.float64)
        torch.testing.assert_close(
            actual, expected, atol=ATOL, rtol=0, msg=lambda m: f"{what}: {m}"
        )

    top_ids = reference["top_ids"]
    close(logits[top_ids], reference["top_logits"], f"logits of the reference top {TOP}")
    close(logits[::STRIDE], reference[f"every_{STRIDE}th"], f"every {STRIDE}th logit")
    close(summary_statistics(logits), reference["mean_std_logsumexp"], "mean, std, logsumexp")
    others = logits.clone()
    others[top_ids] = -torch.inf
    assert others.max() <= reference["top_logits"][-1] + ATOL, f"the top {TOP} tokens changed"


def test_shipped_checkpoints_fit_in_60_mb() -> None:
    missing = [name for name in SHIPPED_MODELS if not (SHIPPED / name).is_dir()]
    assert not missing, f"checkpoints not shipped yet: {missing}"
    size = sum(
        file.stat().st_size
        for name in SHIPPED_MODELS
        for file in (SHIPPED / name).rglob("*")
        if file.is_file()
    )
    assert size <= SIZE_LIMIT_BYTES, f"{size / 1e6:.1f} MB"


def write_reference_logits(only: list[str] | None = None) -> None:
    """Rewrite REFERENCE_LOGITS from the checkpoints as they are now: every one, or ``only``
    these (a new or retrained checkpoint), the others' pins kept as they were."""
    kept = json.loads(REFERENCE_LOGITS.read_text())["schemes"] if only else {}
    schemes = {
        name: fingerprint(*next_token_logits(name)) if not only or name in only else kept[name]
        for name in SHIPPED_MODELS
    }
    text = json.dumps({"prompt": PROMPT, "schemes": schemes}, indent=2)
    # One line per list of numbers keeps the file small and its diffs readable.
    text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m[1].split()) + "]", text)
    REFERENCE_LOGITS.parent.mkdir(exist_ok=True)
    REFERENCE_LOGITS.write_text(text + "\n")
    print(f"wrote {REFERENCE_LOGITS} ({REFERENCE_LOGITS.stat().st_size:,} bytes)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m tests.test_shipped_checkpoints",
        description=f"Pin the shipped checkpoints' logits in {REFERENCE_LOGITS.name}.",
    )
    parser.add_argument("--update", action="store_true", required=True, help="rewrite the file")
    parser.add_argument("--only", help="pin only these checkpoints (comma-separated)")
    arguments = parser.parse_args()
    write_reference_logits(arguments.only.split(",") if arguments.only else None)
