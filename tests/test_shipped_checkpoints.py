"""The checkpoints shipped in ./checkpoints: one per scheme, loadable, generating text, small.

A missing checkpoint fails these tests (it is not skipped): all ten ship with the service.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from model.checkpoint import WEIGHTS_FILE, load_checkpoint
from model.generate import generate
from model.positional import SCHEMES

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
SIZE_LIMIT_BYTES = 40 * 10**6
HALF_PRECISION = {"BF16", "F16"}


def test_one_checkpoint_per_scheme() -> None:
    assert set(SHIPPED_SCHEMES) == set(SCHEMES)


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
