"""The checkpoints shipped in ./checkpoints: one per scheme, loadable, generating text, small.

A missing checkpoint fails these tests (it is not skipped): all ten ship with the service. The
second round's schemes (``NOT_TRAINED_YET``) are registered before their checkpoints exist; they
join ``SHIPPED_SCHEMES`` when those are trained (issue #25, checkpoints/README.md).
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

from model.checkpoint import WEIGHTS_FILE, load_checkpoint
from model.generate import generate
from model.positional import SCHEMES
from model.tokenizer import encode_prompt

SHIPPED = Path(__file__).resolve().parent.parent / "checkpoints"
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
# Registered schemes whose shipped checkpoints are still to be trained (checkpoints/README.md,
# "The second round"): each moves to SHIPPED_SCHEMES with its checkpoint.
NOT_TRAINED_YET = ("fox", "cope", "fire")
SIZE_LIMIT_BYTES = 40 * 10**6
HALF_PRECISION = {"BF16", "F16"}

REFERENCE_LOGITS = Path(__file__).resolve().parent / "data" / "shipped_logits.json"
PROMPT = "ROMEO:\nO, "
TOP = 20
STRIDE = 128  # every 128th logit of the vocabulary is pinned too, not only the top ones
# float32 on CPU: a different thread count moves these logits (|x| < 30) by ~1e-6; a change to
# the model's arithmetic (another GELU, another softmax scale, a wrong position) by far more.
ATOL = 1e-4


def test_one_checkpoint_per_scheme() -> None:
    assert set(SHIPPED_SCHEMES) | set(NOT_TRAINED_YET) == set(SCHEMES)
    assert not set(SHIPPED_SCHEMES) & set(NOT_TRAINED_YET)
    for scheme in NOT_TRAINED_YET:  # once one is trained, it must be tested as shipped
        assert not (SHIPPED / scheme).exists(), f"{scheme} is trained: add it to SHIPPED_SCHEMES"


@pytest.mark.parametrize("scheme", SHIPPED_SCHEMES)
def test_shipped_checkpoint_loads_and_generates(scheme: str) -> None:
    model, tokenizer = load_checkpoint(SHIPPED / scheme, device="cpu")
    assert model.config.positional["scheme"] == scheme
    assert model.config.dtype in ("bfloat16", "float16")
    with safe_open(SHIPPED / scheme / WEIGHTS_FILE, framework="pt") as weights:
        stored = {weights.get_slice(name).get_dtype() for name in weights.keys()}  # noqa: SIM118
    assert stored <= HALF_PRECISION, stored

    (completion,) = generate(model, tokenizer, ["ROMEO:"], max_new_tokens=20)
    assert completion.text.strip(), completion


def next_token_logits(scheme: str) -> tuple[list[int], torch.Tensor]:
    """PROMPT's token ids and the float32 CPU logits after them [vocab], as float64."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a shipped checkpoint carries its checksum
        model, tokenizer = load_checkpoint(SHIPPED / scheme, device="cpu", dtype="float32")
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


@pytest.mark.parametrize("scheme", SHIPPED_SCHEMES)
def test_shipped_logits_match_the_reference(scheme: str) -> None:
    reference = json.loads(REFERENCE_LOGITS.read_text())["schemes"][scheme]
    ids, logits = next_token_logits(scheme)
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


def test_shipped_checkpoints_fit_in_40_mb() -> None:
    missing = [scheme for scheme in SHIPPED_SCHEMES if not (SHIPPED / scheme).is_dir()]
    assert not missing, f"checkpoints not shipped yet: {missing}"
    size = sum(
        file.stat().st_size
        for scheme in SHIPPED_SCHEMES
        for file in (SHIPPED / scheme).rglob("*")
        if file.is_file()
    )
    assert size <= SIZE_LIMIT_BYTES, f"{size / 1e6:.1f} MB"


def write_reference_logits() -> None:
    """Rewrite REFERENCE_LOGITS from the checkpoints as they are now."""
    schemes = {scheme: fingerprint(*next_token_logits(scheme)) for scheme in SHIPPED_SCHEMES}
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
    parser.parse_args()
    write_reference_logits()
