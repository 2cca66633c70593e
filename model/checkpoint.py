"""Checkpoint folders: config.json + model.safetensors + tokenizer.json, verified and swapped in.

Loading
-------
The safetensors header is read with the library's own reader (``safe_open``): every tensor's
name, shape and dtype is checked against the config before any weight is used, and the message
names the file and the first bad tensor. A file the library refuses to open (cut short, a corrupt
header, not safetensors at all) is a :class:`CheckpointError` naming the file. The shapes a config
expects come from a one-block model on the meta device, repeated per block, so a config with
10,000 layers is refused in milliseconds. Before the file is even opened (``safe_open`` maps it
whole), its size is checked against what the config's tensors take, and those against the memory
available (:func:`check_size`); only once the header matches is the file read: its
checksum streamed over in chunks, the tensors copied one by one out of the memory-mapped file
(``safe_open``), so a load never holds the file whole.

The metadata of ``model.safetensors`` holds ``sha256``: the SHA-256 of the file's data section,
the bytes after the 8-byte header length and the JSON header, i.e. every tensor's bytes. The data
section does not depend on the metadata (safetensors orders the tensors by dtype and name), so the
digest is taken from one serialisation and written into a second, and the save checks that both
have the same data section. Loading recomputes it over the file the tensors are then read from
(the same inode and modification time, checked after) and refuses a file whose weights changed;
a file without a checksum (saved before it existed, or by hand) still loads, with a
:class:`UnverifiedWeightsWarning`.

Saving protocol
---------------
A save of the folder ``P`` never writes into ``P``. The steps, each reported by name to the
optional ``on_step`` hook of :func:`save_checkpoint` (so a test can kill the process there):

``staged``
    the complete new folder ``.P.saving-PID`` is written beside ``P`` (other files of the
    checkpoint ``P`` copied in, but not its eval.json or metrics.json) and fsynced. A save
    killed before this leaves ``P`` untouched.

Then, where ``P`` exists and Linux's ``renameat2(RENAME_EXCHANGE)`` works on the filesystem
(:data:`EXCHANGE_STEPS`):

``exchanged``
    one atomic call swaps the two names: ``P`` is now the new checkpoint and ``.P.saving-PID``
    holds the old one;
``removed``
    the old one is deleted.

Where ``P`` does not exist yet: ``installed``, a plain rename of ``.P.saving-PID`` to ``P``.
Elsewhere (no ``renameat2``, or the filesystem refuses the exchange; :data:`RENAME_STEPS`):
``retired`` (``P`` renamed to ``.P.old-PID``), ``installed`` (``.P.saving-PID`` renamed to
``P``), ``removed``. Only there is ``P`` ever missing, between the two renames; the old
checkpoint is then complete in ``.P.old-PID``, and the next save or load of ``P`` renames it back.

So a save killed at any instant leaves at ``P`` the old or the new complete checkpoint (or, with
the two-rename fallback, the old one one rename away, restored on the next access). Leftover
``.P.saving-N`` / ``.P.old-N`` folders whose process ``N`` is gone (a zombie counts as gone) are
deleted by the next save or load of ``P``; a load does this only where it may write, and ignores
a read-only folder. Process ids are only meaningful on one machine and in one PID namespace: two
containers sharing a checkpoint folder must not save the same path at the same time.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import errno
import functools
import hashlib
import math
import os
import re
import shutil
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as serialise_tensors
from tokenizers import Tokenizer

from model.config import ConfigError, ModelConfig
from model.device import resolve_device, resolve_dtype
from model.files import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    WEIGHTS_RECORDS,
    not_a_checkpoint,
    write_json_atomic,
)
from model.memory import available_memory, where_memory_ends
from model.positional import build_scheme
from model.tokenizer import (
    TOKENIZER_CONFIG_FILE,
    check_tokenizer_size,
    load_tokenizer,
    save_tokenizer,
    special_token_config,
)
from model.transformer import Transformer

CHECKPOINT_FILES = (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE)
# What a new save never takes from the folder it replaces: its own files, written afresh, and
# the records of the old weights.
KEPT_APART = (*CHECKPOINT_FILES, *WEIGHTS_RECORDS)
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on a header
CHECKSUM_KEY = "sha256"  # in the safetensors metadata: hex SHA-256 of the data section

# The steps of a save, in the order they happen (see the module docstring).
EXCHANGE_STEPS = ("staged", "exchanged", "removed")  # over an existing checkpoint, renameat2
RENAME_STEPS = ("staged", "retired", "installed", "removed")  # the fallback: two renames
FIRST_SAVE_STEPS = ("staged", "installed")  # nothing at the path yet
SAVE_STEPS = ("staged", "exchanged", "retired", "installed", "removed")


class CheckpointError(ValueError):
    """A checkpoint folder is missing, corrupt or does not match its config."""


class UnverifiedWeightsWarning(UserWarning):
    """A checkpoint's weights carry no SHA-256 checksum, so corruption cannot be detected."""


class LoadedCheckpoint(NamedTuple):
    model: Transformer
    tokenizer: Tokenizer


def stored_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint stores: the state dict without the tied output matrix."""
    state = model.state_dict()
    if model.config.tie_embeddings:
        state.pop("lm_head.weight")
    return state


# ----------------------------------------------------------------------------------------------
# Saving


def save_checkpoint(
    path: str | Path,
    model: Transformer,
    tokenizer: Tokenizer,
    dtype: str | None = None,
    *,
    tokenizer_config: dict[str, Any] | None = None,
    json_files: Mapping[str, Any] | None = None,
    on_step: Callable[[str], None] | None = None,
) -> None:
    """Write ``model`` and ``tokenizer`` to the folder ``path``, replacing it atomically.

    ``dtype`` is the storage dtype (default: the config's). ``json_files`` (name → data) are
    written into the new folder, so they change in the same swap as the weights (training's
    metrics.json). Other files already in the checkpoint (a user's notes, …) are carried over
    into the new one, but not what describes the old weights (eval.json, metrics.json: the new model
    would be shown with the old one's scores) nor hidden files (the ``.NAME.*.tmp`` of an atomic
    write that was killed is no part of the checkpoint). ``tokenizer_config``, if given, is the new
    tokenizer_config.json (else the folder's own is kept, or the default chat template written).
    ``on_step`` is called with the name of each step of the save protocol once it is done (see
    the module docstring).
    """
    path = Path(path)
    config = model.config if dtype is None else model.config.replace(dtype=dtype)
    storage = resolve_dtype(config.dtype)
    tensors = {
        name: tensor.detach().to("cpu", storage).contiguous()
        for name, tensor in stored_tensors(model).items()
    }
    weights = signed_safetensors(tensors)
    with staged_folder(path, on_step) as staging:
        config.save(staging / CONFIG_FILE)
        _write_file(staging / WEIGHTS_FILE, weights)
        save_tokenizer(tokenizer, staging / TOKENIZER_FILE)
        for name, data in (json_files or {}).items():
            write_json_atomic(staging / name, data)
        if not_a_checkpoint(path) is None:  # a folder forced over (--force) is replaced whole
            for extra in path.iterdir():
                carried = not (staging / extra.name).exists() and extra.is_file()
                if carried and extra.name not in KEPT_APART and extra.name[0] != ".":
                    shutil.copy2(extra, staging / extra.name)
        if tokenizer_config is not None:
            write_json_atomic(staging / TOKENIZER_CONFIG_FILE, tokenizer_config)
        elif not (staging / TOKENIZER_CONFIG_FILE).exists():  # a checkpoint's own is kept
            # Imported here: the template's module brings jinja2, which the engine, loading
            # checkpoints and never writing one, does without.
            from model.chat import default_tokenizer_config

            default = {**default_tokenizer_config(), **special_token_config(tokenizer)}
            write_json_atomic(staging / TOKENIZER_CONFIG_FILE, default)


@contextlib.contextmanager
def staged_folder(path: str | Path, on_step: Callable[[str], None] | None = None) -> Iterator[Path]:
    """An empty folder beside ``path`` to write a whole new folder into; when the block ends
    without error it is fsynced and swapped in for ``path`` by the save protocol of the module
    docstring (``on_step`` hears each step), and on error it is removed, ``path`` untouched.
    Any folder written as a unit uses it: checkpoints, exported Hugging Face folders."""
    path = Path(path)
    step = on_step or _no_hook
    staging, retired = _temporary(path, "saving"), _temporary(path, "old")
    path.parent.mkdir(parents=True, exist_ok=True)
    with _SAVE_LOCK:
        _clean_up_after_killed_saves(path)
        _ACTIVE.update((staging, retired))
        try:
            staging.mkdir()
            yield staging
            for file in staging.iterdir():
                file.chmod(0o644)
            _fsync_folder(staging)
            step("staged")
            _swap_in(staging, retired, path, step)
        except BaseException:
            # Before the swap this is the half-built new folder; after an exchange, the old one.
            _remove(staging)
            raise
        finally:
            _ACTIVE.difference_update((staging, retired))


def signed_safetensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """``tensors`` serialised as safetensors, with the SHA-256 of the data in the metadata."""
    unsigned = serialise_tensors(tensors, metadata={"format": "pt"})
    digest = hashlib.sha256(data_section(unsigned)).hexdigest()
    signed = serialise_tensors(tensors, metadata={"format": "pt", CHECKSUM_KEY: digest})
    if data_section(signed) != data_section(unsigned):  # the layout claim the digest rests on
        raise RuntimeError("safetensors laid the tensors out differently with other metadata")
    return signed


def data_section(raw: bytes) -> memoryview:
    """The bytes of a safetensors file after its 8-byte header length and JSON header."""
    return memoryview(raw)[8 + int.from_bytes(raw[:8], "little") :]


def _swap_in(staging: Path, retired: Path, path: Path, step: Callable[[str], None]) -> None:
    """Put the complete folder ``staging`` at ``path`` (the steps after ``staged``)."""
    if not os.path.lexists(path):
        os.replace(staging, path)
        _fsync_folder_entry(path.parent)
        step("installed")
    elif _exchange(staging, path):
        _fsync_folder_entry(path.parent)
        step("exchanged")
        _remove(staging)  # whatever is left goes with the next save
        step("removed")
    else:
        os.replace(path, retired)
        try:
            step("retired")
            os.replace(staging, path)
        except BaseException:
            os.replace(retired, path)
            raise
        _fsync_folder_entry(path.parent)
        step("installed")
        _remove(retired)
        step("removed")


def _remove(path: Path) -> None:
    """Delete what a swap left at ``path``: a folder, or the file a forced save replaced."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _no_hook(step: str) -> None:
    pass


def _write_file(file: Path, data: bytes) -> None:
    file.write_bytes(data)


def _fsync_folder(folder: Path) -> None:
    for file in folder.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    _fsync_folder_entry(folder)


def _fsync_folder_entry(folder: Path) -> None:
    """Make the folder's list of names durable (where folders can be opened: not on Windows)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# renameat2(2): AT_FDCWD makes both paths relative to the working directory, like rename(2).
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_EXCHANGE_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}


@functools.cache
def _renameat2() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2  # glibc ≥ 2.28
    except (OSError, AttributeError):
        return None
    function.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    function.restype = ctypes.c_int
    return function


def _exchange(first: Path, second: Path) -> bool:
    """Swap the names ``first`` and ``second`` in one atomic step; False where unsupported."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    names = os.fsencode(first), os.fsencode(second)
    if renameat2(_AT_FDCWD, names[0], _AT_FDCWD, names[1], _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _EXCHANGE_UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


# Saves in this process run one at a time; _ACTIVE names the temporary folders in use by the
# save now running, so that a load in another thread leaves them alone.
_SAVE_LOCK = threading.RLock()
_ACTIVE: set[Path] = set()


def _temporary(path: Path, kind: str) -> Path:
    return path.parent / f".{path.name}.{kind}-{os.getpid()}"


def _clean_up_after_killed_saves(path: Path) -> None:
    """Restore ``path`` from a save killed between two renames and delete its leftovers."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(?P<kind>saving|old)-(?P<pid>[0-9]+)")
    stale: dict[Path, str] = {}
    for name in os.listdir(path.parent):
        match = pattern.fullmatch(name)
        if match and not _in_use(path.parent / name, int(match["pid"])):
            stale[path.parent / name] = match["kind"]
    retired = sorted(folder for folder, kind in stale.items() if kind == "old")
    if retired and not os.path.lexists(path):
        os.replace(retired[0], path)  # complete: a folder is retired only after staging is
        _fsync_folder_entry(path.parent)
        del stale[retired[0]]
    for folder in stale:
        _remove(folder)


def _in_use(folder: Path, pid: int) -> bool:
    if pid == os.getpid():
        return folder in _ACTIVE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    try:  # a killed process nobody has reaped yet still answers signal 0
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


# ----------------------------------------------------------------------------------------------
# Loading


def load_checkpoint(
    path: str | Path,
    device: str | torch.device | None = None,
    dtype: str = "float32",
    positional_overrides: dict[str, Any] | None = None,
) -> LoadedCheckpoint:
    """Load a checkpoint folder → (model in eval mode, tokenizer).

    ``dtype`` is the run dtype, independent of the stored one. ``positional_overrides`` changes
    positional parameters at load time, e.g. ``{"scaling": "ntk", "scaling_factor": 4.0}`` to let
    a rope model serve 4× its training context.
    """
    path = Path(path)
    with contextlib.suppress(OSError):  # a read-only folder: nothing to repair there
        _clean_up_after_killed_saves(path)
    for name in CHECKPOINT_FILES:
        if not (path / name).is_file():
            raise CheckpointError(f"{path} is not a checkpoint: {name} is missing")
    try:
        config = ModelConfig.load(path / CONFIG_FILE)
        if positional_overrides:
            config = config.replace(positional={**config.positional, **positional_overrides})
    except ConfigError as error:
        raise CheckpointError(f"{path / CONFIG_FILE}: {error}") from None
    # By its size, before anything is read: the engine loads beside the models that serve, and
    # parsing a tokenizer holds the GIL (a million added tokens: 12 s without a token out).
    check_tokenizer_size(path / TOKENIZER_FILE, config.vocab_size)

    tensors = read_weights(path / WEIGHTS_FILE, config)  # checked before a model is built
    if config.tie_embeddings:
        tensors["lm_head.weight"] = tensors["token_embedding.weight"]

    tokenizer = load_tokenizer(path / TOKENIZER_FILE)
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise CheckpointError(
            f"{path / TOKENIZER_FILE} has {tokenizer.get_vocab_size()} tokens but the model's "
            f"vocab_size is {config.vocab_size}"
        )

    model = Transformer(config)
    model.load_state_dict(tensors)
    model.to(device=device or resolve_device("auto"), dtype=resolve_dtype(dtype))
    return LoadedCheckpoint(model.eval(), tokenizer)


def read_weights(weights_path: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors in ``weights_path`` (CPU), once they match ``config``, fit the memory
    available and match their checksum; the file is never read whole."""
    expected_digest = check_weights(weights_path, config)
    with open(weights_path, "rb") as handle:
        before = os.fstat(handle.fileno())
        # A file without a checksum is not read through for one nobody compares.
        digest = None if expected_digest is None else data_digest(handle)
    if expected_digest is None:
        warnings.warn(
            f"{weights_path} has no SHA-256 checksum: its weights cannot be verified "
            f"(save the checkpoint again to add one)",
            UnverifiedWeightsWarning,
            stacklevel=3,
        )
    elif digest != expected_digest:
        raise CheckpointError(
            f"{weights_path}: weights do not match their SHA-256 checksum (the file is corrupt)"
        )
    try:
        with safe_open(str(weights_path), framework="pt") as weights:
            tensors = {name: weights.get_tensor(name) for name in weights.keys()}  # noqa: SIM118
    except SafetensorError as error:  # replaced since check_weights read it
        raise _unreadable(weights_path, error) from None
    after = os.stat(weights_path)
    if (after.st_ino, after.st_mtime_ns) != (before.st_ino, before.st_mtime_ns):
        raise CheckpointError(f"{weights_path} was replaced while it was being loaded")
    return tensors


def data_digest(handle: BinaryIO, chunk: int = 1 << 20) -> str:
    """The SHA-256 of a safetensors file's data section, read ``chunk`` bytes at a time."""
    header_length = int.from_bytes(handle.read(8), "little")
    handle.seek(8 + header_length)
    digest = hashlib.sha256()
    while block := handle.read(chunk):
        digest.update(block)
    return digest.hexdigest()


def check_size(weights_path: Path, config: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> None:
    """A CheckpointError, before the file is opened, when it is far larger than the tensors of
    ``config`` (``shapes``) or when those need more memory than is available: mapping or
    loading it would fail, or get the process killed by the kernel."""
    needed = (
        sum(math.prod(shape) for shape in shapes.values()) * resolve_dtype(config.dtype).itemsize
    )
    size = os.path.getsize(weights_path)
    if size > needed + MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{weights_path} is {size / 2**30:.1f} GiB but the tensors of its config take "
            f"{needed / 2**30:.3f} GiB"
        )
    available = available_memory()  # the machine's or the cgroup's, whichever is less
    if available is not None and needed > available:
        raise CheckpointError(
            f"{weights_path}: the weights need {needed / 2**30:.1f} GiB but only "
            f"{available / 2**30:.1f} GiB of memory is available {where_memory_ends()}"
        )


def with_positional(model: Transformer, overrides: dict[str, Any]) -> Transformer:
    """``model`` with its positional parameters changed (e.g. rope's scaling), sharing every
    weight with it: no tensor is copied, so a variant costs only its scheme's own tables.

    Only for schemes without learned positional parameters (rope's scalings): the variant's
    scheme is built afresh from the changed config.
    """
    config = model.config.replace(positional={**model.config.positional, **overrides})
    scheme = build_scheme(config)
    if any(True for _ in scheme.parameters()):
        raise ValueError(f"scheme '{config.scheme}' has learned positions: no variant of it")
    variant = copy.copy(model)  # the same parameters, buffers and submodules...
    variant._modules = dict(model._modules)  # ...in a module table of its own
    variant.config = config
    variant.positional = scheme.to(model.token_embedding.weight.device)
    return variant


def check_weights(weights_path: Path, config: ModelConfig) -> str | None:
    """Check names, shapes and dtypes in ``weights_path`` against ``config``, before any model
    of it is built (a config of 10,000 layers fails here in milliseconds, allocating nothing).

    Returns the SHA-256 recorded in its metadata (None when it has none).
    """
    expected = expected_shapes(config)
    check_size(weights_path, config, expected)
    try:
        with safe_open(str(weights_path), framework="pt") as weights:
            metadata = weights.metadata() or {}
            stored: dict[str, tuple[tuple[int, ...], str]] = {}
            for name in weights.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = weights.get_slice(name)
                stored[name] = (tuple(tensor.get_shape()), tensor.get_dtype())
    except SafetensorError as error:
        raise _unreadable(weights_path, error) from None
    missing = sorted(set(expected) - set(stored))
    if missing:
        raise CheckpointError(f"{weights_path}: tensor {missing[0]!r} is missing")
    unexpected = sorted(set(stored) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"{weights_path}: unexpected tensor {unexpected[0]!r} (not part of a "
            f"'{config.scheme}' model with this config)"
        )
    for name, shape in expected.items():
        stored_shape, stored_dtype = stored[name]
        if stored_shape != shape:
            raise CheckpointError(
                f"{weights_path}: tensor {name!r} has shape {stored_shape}, "
                f"the config expects {shape}"
            )
        stored_dtype = SAFETENSORS_DTYPES.get(stored_dtype, stored_dtype)
        if stored_dtype != config.dtype:
            raise CheckpointError(
                f"{weights_path}: tensor {name!r} is stored as {stored_dtype}, config.json says "
                f"{config.dtype}"
            )
    return metadata.get(CHECKSUM_KEY)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor a checkpoint of ``config`` stores, without building its
    ``n_layers`` blocks: a one-block model on the meta device, its block's tensors repeated, and
    the scheme of the whole config (fox's and cope's tensors have a row per layer)."""
    with torch.device("meta"):
        one_block = stored_tensors(Transformer(config.replace(n_layers=1)))
        scheme = build_scheme(config).state_dict()
    shapes: dict[str, tuple[int, ...]] = {}
    for name, tensor in one_block.items():
        if name.startswith("blocks.0."):
            rest = name.removeprefix("blocks.0.")
            shapes.update(
                {f"blocks.{i}.{rest}": tuple(tensor.shape) for i in range(config.n_layers)}
            )
        elif not name.startswith("positional."):
            shapes[name] = tuple(tensor.shape)
    shapes.update({f"positional.{name}": tuple(tensor.shape) for name, tensor in scheme.items()})
    return shapes


def _unreadable(weights_path: Path, error: Exception) -> CheckpointError:
    return CheckpointError(
        f"{weights_path} is truncated or corrupt: not a readable safetensors file ({error})"
    )
