"""ordinal's model package: config → transformer (with a positional scheme) → sampling.

``from model import ModelConfig, Transformer, load_checkpoint, save_checkpoint``
"""

from model.cache import KVCache
from model.checkpoint import LoadedCheckpoint, load_checkpoint, save_checkpoint
from model.config import ConfigError, ModelConfig
from model.transformer import Transformer

__all__ = [
    "ConfigError",
    "KVCache",
    "LoadedCheckpoint",
    "ModelConfig",
    "Transformer",
    "load_checkpoint",
    "save_checkpoint",
]
