"""Shared fixtures for the model-core tests: tiny configs for every scheme, random models whose
positions really matter, and a tiny byte-level BPE tokenizer (built here, not by
model.tokenizer, so these tests do not depend on it)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from model.config import ModelConfig
from model.positional import SCHEMES
from model.transformer import Transformer

ALL_SCHEMES = tuple(SCHEMES)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
TINY_VOCAB = 320  # ≥ the tokenizer's ~300 tokens

# These models are tiny: a second thread only adds synchronisation, which on a busy shared
# machine made each forward ~100× slower (0.2 s instead of 1 ms).
torch.set_num_threads(1)

# Small enough that every scheme's parameters fit d_model=32 and 4 heads of 8 dims.
SCHEME_SETTINGS: dict[str, dict[str, Any]] = {
    "none": {},
    "integer": {"scale": 0.05},
    "binary": {"bits": 8, "scale": 1.0},
    "sinusoidal": {},
    "learned": {},
    "rope": {},
    "alibi": {},
    "t5": {"num_buckets": 8, "max_distance": 24},
    "mds": {"rank": 8, "scale": 1.0},
    "lowrank": {"rank": 4},
    "fox": {},
    "cope": {"n_positions": 16},  # few enough rows that every one is reached (and trained)
    # randomise() redraws L's multiplier as N(0, 0.3²): × 100 keeps some queries of a test's
    # 24-31 tokens below L, so that L matters (and gets a gradient).
    "fire": {"threshold": 100.0},
    # a NoPE layer after a rope layer with a window of 8, its queries sharpened past position 16
    "irope": {"layers": "rope,none", "window": 8, "temperature_floor": 16},
    "stickbreaking": {},
    "pope": {},
    "path": {},
    "pathfox": {},
}


def tiny_config(scheme: str = "rope", **overrides: Any) -> ModelConfig:
    """A config small enough to run many forwards per second on one core.

    ``integer`` gets RMSNorm: LayerNorm subtracts the mean over dimensions, which removes a
    position added equally to every dimension, so under LayerNorm that scheme equals NoPE.
    """
    fields: dict[str, Any] = {
        "vocab_size": TINY_VOCAB,
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 4,
        "d_ff": 64,
        "context_length": 48,
        "max_positions": 64,
        "norm": "rmsnorm" if scheme == "integer" else "layernorm",
        "positional": {"scheme": scheme, **SCHEME_SETTINGS[scheme]},
    }
    fields.update(overrides)
    return ModelConfig(**fields)


def randomise(model: Transformer, seed: int, positional_std: float = 0.3) -> Transformer:
    """Re-draw every weight so that positions and content both move the logits visibly.

    GPT-2's 0.02 initialisation makes all logits nearly equal, which would let a wrong position
    pass a 1e-4 comparison; positional tables and stored buffers (mds coordinates) get
    ``positional_std``. Buffers that are not stored (alibi's slopes) are derived, so kept.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.startswith("positional."):
                std = positional_std
            elif "norm" in name:
                tensor.copy_(1 + 0.1 * torch.randn(tensor.shape, generator=generator))
                continue
            else:
                std = 0.15
            tensor.copy_(std * torch.randn(tensor.shape, generator=generator))
    return model


def random_model(scheme: str = "rope", seed: int = 0, **overrides: Any) -> Transformer:
    """A randomised tiny model for ``scheme`` in eval mode (float32)."""
    torch.manual_seed(seed)
    return randomise(Transformer(tiny_config(scheme, **overrides)), seed).eval()


def random_tokens(batch: int, length: int, seed: int, vocab: int = TINY_VOCAB) -> torch.Tensor:
    """Uniform random token ids → [batch, length] (long)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (batch, length), generator=generator)


TRAINING_TEXT = [
    "Now is the winter of our discontent made glorious summer by this sun of York.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.",
    "All the world's a stage, and all the men and women merely players.",
    "If music be the food of love, play on; give me excess of it.",
    "We are such stuff as dreams are made on, and our little life is rounded with a sleep.",
    "Fair is foul, and foul is fair: hover through the fog and filthy air.",
]


def build_tiny_tokenizer(vocab_size: int = 300) -> Tokenizer:
    """A byte-level BPE tokenizer trained on a few sentences, with the project's special tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer=trainer)
    return tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Tokenizer:
    return build_tiny_tokenizer()


def tree_digest(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (hidden ones too: a staging folder left behind shows) → the
    SHA-256 of a file's bytes, a symlink's target, or "folder": equal before and after a command
    exactly when it changed nothing on disk there."""
    entries = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_symlink():
            entries[name] = f"-> {os.readlink(path)}"
        elif path.is_dir():
            entries[name] = "folder"
        else:
            entries[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return entries
