"""C++ kernels for the few computations torch cannot fuse, built by ``make setup`` or on first use.

Each kernel is a ``.cpp`` file here, compiled by torch's own extension builder
(``torch.utils.cpp_extension``) with the C++ compiler that ``torch.compile`` needs on a CPU anyway,
and cached under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``): the first use
on a machine takes about half a minute, later ones a moment. Each has a pure-torch reference
that defines it (the scheme's module) and tests that hold the two equal. Where the build cannot
run (no compiler, no ninja), :func:`load` says so once on stderr and returns None, and callers use
the reference: the same numbers, more slowly.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

HERE = Path(__file__).parent

# -O3 -march=native: the kernel is built on the machine that runs it. -ffast-math lets the
# compiler call glibc's vectorised expf for σ (compile flags only: the link leaves the process's
# floating-point mode alone). -fopenmp: at::parallel_for and `omp simd` need it.
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


KERNELS = ("linear", "cope", "fox", "decode_step", "argmax", "draw")  # every .cpp here


def decoding_on_cpu(x: Tensor) -> bool:
    """Whether ``x`` belongs to a pass the decode kernels take: no gradients (autograd cannot
    see into them), float32 on a CPU, and outside torch.compile (which cannot trace a call
    into an extension)."""
    return (
        not torch.is_grad_enabled()
        and x.dtype is torch.float32
        and x.is_cpu
        and not torch.compiler.is_compiling()
    )


@functools.cache
def vectorised(name: str) -> bool:
    """Whether kernel ``name`` is built (building it on first call) with its AVX-512 code: on a
    CPU without AVX-512 its build has only a stub, and the torch code runs instead."""
    extension = load(name)
    return extension is not None and bool(extension.vectorised())


def build_all() -> None:
    """Build every kernel now (``make setup``), so that the first ``ordinal serve`` on a machine
    does not spend a minute and a half compiling before its first model serves."""
    for name in KERNELS:
        load(name)


@functools.cache
def load(name: str) -> ModuleType | None:
    """The built extension for ``{name}.cpp`` here, or None (with a note) if it cannot be built."""
    from torch.utils import cpp_extension

    try:
        _wait_out_lock(Path(cpp_extension._get_build_directory(f"ordinal_{name}", False)))
        return cpp_extension.load(
            name=f"ordinal_{name}",
            sources=[str(HERE / f"{name}.cpp")],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
        )
    except (OSError, RuntimeError, ImportError) as error:  # no compiler, no ninja, build failed
        text = str(error).strip()
        first_line = text.splitlines()[0] if text else type(error).__name__
        print(
            f"note: the {name} kernel could not be built ({first_line}); using the torch "
            "reference: the same results, slower",
            file=sys.stderr,
        )
        return None


STALE_LOCK_SECONDS = 180  # a build takes ~30 s here: a lock this old has no build behind it
LOCK_POLL = 0.5  # seconds between looks at another build's lock


def _wait_out_lock(build_directory: Path) -> None:
    """Wait while another process builds this kernel (its lock is in the build directory), and
    remove a lock once it is ``STALE_LOCK_SECONDS`` old: a killed build leaves its lock, and
    torch waits on a lock forever. (Looking once and removing only 10-minute-old locks left a
    server restarted within 10 minutes of a killed build with a model loading for good.)"""
    lock = build_directory / "lock"
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_SECONDS:
            print(
                f"note: removing a stale kernel build lock, {age:.0f} s old: {lock}",
                file=sys.stderr,
            )
            lock.unlink(missing_ok=True)
            return
        time.sleep(LOCK_POLL)
