"""Which kernel variant this CPU runs, and which one this process chooses (``ORDINAL_CPU_ISA``).

No torch: ``ordinal serve`` checks the variable before it starts anything, and the benchmarks
name the variant beside their figures. ``model.kernels`` builds and loads the variants.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

ENVIRONMENT = "ORDINAL_CPU_ISA"
NO_KERNELS = "torch"  # ORDINAL_CPU_ISA=torch: the torch code everywhere

CPU_NEEDS: dict[str, frozenset[str]] = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "neon": frozenset(),
    "scalar": frozenset(),
}
ARCHITECTURE_ISAS = {"x86_64": ("avx512", "avx2", "scalar"), "aarch64": ("neon",)}


class IsaError(ValueError):
    """ORDINAL_CPU_ISA names a variant this CPU cannot run, or none there is."""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty where /proc/cpuinfo has none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.cache
def runnable() -> tuple[str, ...]:
    """The variants this CPU runs, fastest first (none on an architecture without one)."""
    flags = cpu_flags()
    isas = ARCHITECTURE_ISAS.get(platform.machine(), ())
    return tuple(isa for isa in isas if CPU_NEEDS[isa] <= flags)


def widest() -> str | None:
    """The fastest vector variant this CPU runs (what runs unless one is forced), or None where
    it runs none: the scalar variant is not a vector one (``chosen`` says why it is not run)."""
    return next((isa for isa in runnable() if isa != "scalar"), None)


@functools.cache
def chosen() -> str | None:
    """The variant this process runs: ``ORDINAL_CPU_ISA``'s, else the fastest vector variant this
    CPU runs; None for ``ORDINAL_CPU_ISA=torch`` or where none runs. The scalar variant runs only
    when asked for: without a fused multiply-add instruction its every product is a call into
    libm (exact, for the same bits), slower than torch's own code on such a CPU. Raises IsaError
    for a variant the CPU cannot run."""
    wanted = os.environ.get(ENVIRONMENT, "").strip().lower()
    if wanted == NO_KERNELS:
        return None
    if not wanted:
        return widest()
    if wanted not in runnable():
        known = ", ".join([*CPU_NEEDS, NO_KERNELS])
        raise IsaError(
            f"{ENVIRONMENT}={wanted}: this CPU runs {', '.join(runnable()) or 'no variant'} "
            f"(the variants: {known})"
        )
    return wanted
