"""The model tests' fixtures, for the doors' tests too (tests/model/conftest.py), and tiny random
checkpoints of what no shipped checkpoint has."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from model.checkpoint import save_checkpoint
from tests.model.conftest import random_model, tiny_tokenizer  # noqa: F401

# What no shipped checkpoint covers (irope's window and temperature; stick-breaking's biases; pope's
# base, untied output and phase biases past its clamp; PaTH-FoX), as tiny random checkpoints stored
# in bfloat16 as the shipped ones are: scheme → config changes. Each is exported and checked as a
# shipped checkpoint is (tests/interop/test_export.py), and imported back bit for bit
# (test_roundtrip.py).
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
    "pope": {"tie_embeddings": False, "positional": {"scheme": "pope", "base": 500.0}},
    "pathfox": {"bias": True},
}
# Parameters redrawn uniform in [low, high] after random_model's N(0, 0.3): scheme → (name, low,
# high). pope's δ past both ends of its clamp to [−2π, 0], which the port must apply as ordinal.
TINY_SPREADS: dict[str, tuple[str, float, float]] = {
    "pope": ("positional.phase_bias", -8.0, 1.0),
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
        if scheme in TINY_SPREADS:
            name, low, high = TINY_SPREADS[scheme]
            with torch.no_grad():
                generator = torch.Generator().manual_seed(5)
                model.get_parameter(name).uniform_(low, high, generator=generator)
        save_checkpoint(root / scheme, model, tiny_tokenizer, dtype="bfloat16")
    return {scheme: root / scheme for scheme in TINY_CHECKPOINTS}
