"""The model tests' fixtures, for the doors' tests too (tests/model/conftest.py), and tiny random
checkpoints of what no shipped checkpoint has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from model.checkpoint import save_checkpoint
from tests.model.conftest import random_model, tiny_tokenizer  # noqa: F401

# Schemes no shipped checkpoint covers (irope's window and temperature; stick-breaking), as tiny
# random checkpoints stored in bfloat16 as the shipped ones are: scheme → config changes. Each is
# exported and checked as a shipped checkpoint is (tests/interop/test_export.py), and imported
# back bit for bit (test_roundtrip.py).
TINY_CHECKPOINTS: dict[str, dict[str, Any]] = {
    # layer 2 NoPE (of 4), rope layers seeing their last 6 keys, a temperature from position 7
    "irope": {
        "n_layers": 4,
        "tie_embeddings": False,
        "positional": {
            "scheme": "irope",
            "layers": "rope,rope,none",
            "window": 6,
            "temperature_floor": 8,
            "temperature_scale": 0.5,
            "rotary_fraction": 0.5,
        },
    },
    "stickbreaking": {"bias": True},
}


@pytest.fixture(scope="session")
def tiny_checkpoints(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_tokenizer: Tokenizer,  # noqa: F811
) -> dict[str, Path]:
    """Each of TINY_CHECKPOINTS saved as a checkpoint folder: scheme → folder."""
    root = tmp_path_factory.mktemp("tiny-checkpoints")
    for scheme, changes in TINY_CHECKPOINTS.items():
        model = random_model(scheme, seed=5, **changes)
        save_checkpoint(root / scheme, model, tiny_tokenizer, dtype="bfloat16")
    return {scheme: root / scheme for scheme in TINY_CHECKPOINTS}
