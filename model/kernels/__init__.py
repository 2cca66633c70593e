"""C++ kernels for the few computations torch cannot fuse: one source, one library per CPU ISA.

Every kernel here is written once, over the portable SIMD layer in ``simd.h`` (a 16-lane vector
type the compiler lowers to each ISA's registers). A *variant* is every ``.cpp`` here compiled
for one ISA into one library, whose ops are registered as ``torch.ops.ordinal_<isa>``:

- ``avx512``: AVX-512 (Skylake-SP and later; Zen 4), with the AMX tile path where the CPU has it;
- ``avx2``: AVX2 and FMA (Haswell and later; every Zen);
- ``scalar``: the architecture's baseline (SSE2 on x86-64): the same bits on anything older,
  run when asked for (:func:`chosen` says why);
- ``neon``: aarch64's baseline (built by the cross-compile check; aarch64 machines build it).

Which variant runs is chosen once per process (:func:`chosen`), by what the CPU reports, unless
``ORDINAL_CPU_ISA`` names one (``avx512``, ``avx2``, ``scalar``, or ``torch`` for none at all):
so an AVX-512 machine tests and benchmarks the AVX2 code too. Every variant computes the same
bits (``simd.h`` says why), so the choice is one of speed alone.

Each variant is built by torch's extension builder (``torch.utils.cpp_extension``), with the
C++ compiler that ``torch.compile`` needs on a CPU anyway, into a folder named by a digest of
the sources, the flags, torch and Python (:func:`library_name`): two checkouts with the same
sources share one build, and two with different sources never rebuild each other's. ``make
setup`` builds the variants this CPU runs, in parallel (:func:`build_all`); a library already
built loads without a compiler (the Docker image's way). Where a build cannot run (no compiler,
no ninja), :func:`ops` says so once on stderr and returns None, and callers use the torch
reference: the same numbers, more slowly.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from model.cpu import IsaError, chosen, runnable

HERE = Path(__file__).parent

# Flags every variant shares. -ffp-contract=off: no variant fuses a product another rounds (the
# variants compute the same bits; simd.h). -fno-math-errno: sqrt is one instruction. -fopenmp:
# at::parallel_for's threads (its loops are compiled here).
# -Wno-psabi: simd.h's 64-byte vectors pass between inlined functions only, never across an ABI.
COMMON_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-Wno-psabi"]
# Each variant's ISA, and the CPU flags (/proc/cpuinfo's) it needs to run, best first.
ISA_FLAGS: dict[str, list[str]] = {
    "avx512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-mamx-tile",  # the tile path runs only where the CPU has AMX (linear.tiles_ready)
        "-mamx-bf16",
    ],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "neon": [],
    "scalar": [],
}
_override: list[str | None] = []  # using()'s stack: the tests' and benchmarks' choice


def active() -> str | None:
    """The variant in use now: :func:`using`'s, else :func:`chosen`."""
    return _override[-1] if _override else chosen()


@contextlib.contextmanager
def using(isa: str | None) -> Iterator[None]:
    """Run the kernels of variant ``isa`` (None: none, the torch code) inside this block: the
    tests run every variant the machine can, a benchmark compares them."""
    if isa is not None and isa not in runnable():
        raise IsaError(f"this CPU cannot run the {isa} variant (it runs {', '.join(runnable())})")
    _override.append(isa)
    try:
        yield
    finally:
        _override.pop()


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


def sources() -> list[Path]:
    """Every kernel source here: each variant compiles all the .cpp files (the headers are
    included by them)."""
    return sorted(HERE.glob("*.cpp"))


def unity_source(directory: Path) -> Path:
    """One file in ``directory`` that includes every source: a variant is one translation unit,
    so torch's headers are parsed once per variant rather than once per kernel (most of a
    kernel's compile time), and the variants build side by side, one per core."""
    unity = directory / "unity.cpp"
    text = "".join(f'#include "{path}"\n' for path in sources())
    if not unity.exists() or unity.read_text() != text:
        unity.write_text(text)
    return unity


def flags(isa: str) -> list[str]:
    """The compiler flags of variant ``isa``: the shared ones, the ISA's, and the name its ops
    are registered under."""
    return [*COMMON_FLAGS, *ISA_FLAGS[isa], f"-DORDINAL_OPS=ordinal_{isa}"]


def library_name(isa: str) -> str:
    """``ordinal_<isa>_<digest>``: the digest of every source and header here, the flags, torch's
    version and Python's, so that a build is reused only by the same code."""
    digest = hashlib.sha256()
    for path in sorted([*HERE.glob("*.cpp"), *HERE.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(flags(isa)).encode())
    digest.update(f"{torch.__version__} {sys.version_info[:2]}".encode())
    return f"ordinal_{isa}_{digest.hexdigest()[:12]}"


def build_directory(isa: str) -> Path:
    """Where variant ``isa`` is built: torch's extension folder (``TORCH_EXTENSIONS_DIR``)."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(library_name(isa), False))


def build_all(isas: Iterable[str] | None = None) -> None:
    """Build variants ``isas`` (default: every one this CPU runs) now, in parallel: ``make
    setup`` builds them so that the first ``ordinal serve`` does not compile before its first
    model serves, and the Docker image's build stage every x86-64 variant, for whatever CPU
    runs it (built, not loaded: a CPU may compile a variant it cannot run)."""
    chosen_isas = list(runnable() if isas is None else isas)
    unknown = [isa for isa in chosen_isas if isa not in ISA_FLAGS]
    if unknown:
        raise IsaError(
            f"no kernel variant {', '.join(unknown)} (the variants: {', '.join(ISA_FLAGS)})"
        )
    with ThreadPoolExecutor(max_workers=max(1, len(chosen_isas))) as pool:
        list(pool.map(build, chosen_isas))


def build(isa: str) -> Path:
    """Variant ``isa``'s library, built first if it is not there (another process building it
    is waited for) → its path. Raises what the build raised (no compiler, no ninja, an error)."""
    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    _find_ninja()
    name = library_name(isa)
    directory = build_directory(isa)
    library = directory / f"{name}.so"
    directory.mkdir(parents=True, exist_ok=True)
    while not library.exists():
        baton = FileBaton(str(directory / "lock"))
        if not baton.try_acquire():
            _wait_out_lock(directory)  # another process builds it: its .so is not whole yet
            continue
        try:
            # What cpp_extension.load builds with, without its loading: a variant this CPU
            # cannot run must not be loaded (its static initialisers may use the ISA).
            cpp_extension._write_ninja_file_and_build_library(
                name=name,
                sources=[str(unity_source(directory))],
                extra_cflags=flags(isa),
                extra_cuda_cflags=None,
                extra_sycl_cflags=None,
                extra_ldflags=["-fopenmp"],
                extra_include_paths=None,
                build_directory=str(directory),
                verbose=False,
                with_cuda=False,
                with_sycl=False,
            )
        finally:
            baton.release()
    return library


def _find_ninja() -> None:
    """Put the ``ninja`` package's binary on PATH where no ninja is (torch's builder calls
    ``ninja`` by name; a virtual environment's bin folder is on PATH only when activated)."""
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


@functools.cache
def _ops(isa: str) -> Any:
    """Variant ``isa``'s ops (``torch.ops.ordinal_<isa>``), built first if need be, or None
    (with a note) if it cannot be built."""
    try:
        torch.ops.load_library(str(build(isa)))
    except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as error:
        text = str(error).strip()  # no compiler, no ninja, a build that failed
        first_line = text.splitlines()[0] if text else type(error).__name__
        print(
            f"note: the {isa} kernels could not be built ({first_line}); using the torch "
            "reference: the same results, slower",
            file=sys.stderr,
        )
        return None
    return getattr(torch.ops, f"ordinal_{isa}")


def ops(isa: str | None = None) -> Any:
    """The ops of variant ``isa`` (default: :func:`active`), building it on first use; None
    where there is none to use (``ORDINAL_CPU_ISA=torch``, or a build that failed)."""
    isa = active() if isa is None else isa
    return None if isa is None else _ops(isa)


def ready() -> bool:
    """Whether the active variant's kernels are built (building them on first call)."""
    return ops() is not None


STALE_LOCK_SECONDS = 180  # a build takes under a minute: a lock this old has no build behind it
LOCK_POLL = 0.5  # seconds between looks at another build's lock


def _wait_out_lock(build_directory: Path) -> None:
    """Wait while another process builds this variant (its lock is in the build directory), and
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
