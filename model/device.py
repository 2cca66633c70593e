"""Where a model runs and the dtype it runs in: the names every command and setting accepts, and
the one place a name becomes a torch object.

The names are torch-free (``ordinal --help`` and the API process's settings list them); torch
is imported only when a name is resolved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

from model.errors import ConfigError

if TYPE_CHECKING:
    import torch

Device = Literal["auto", "cpu", "cuda"]  # auto = cuda when torch sees one, else cpu
Dtype = Literal["float32", "bfloat16", "float16"]
DEVICES: tuple[str, ...] = get_args(Device)
DTYPES: tuple[str, ...] = get_args(Dtype)


def resolve_device(name: str) -> torch.device:
    """``auto`` → cuda when torch sees a CUDA device, else cpu; any other name as given
    (``cuda:1`` included)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype of one of :data:`DTYPES` (another name is a ConfigError)."""
    import torch

    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of {list(DTYPES)}, got {name!r}")
    return getattr(torch, name)
