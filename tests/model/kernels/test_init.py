"""model.kernels: ``make setup`` builds every kernel source there is."""

from __future__ import annotations

from pathlib import Path

import model.kernels as kernels


def test_every_kernel_source_is_built_by_build_all() -> None:
    """``build_all`` (``make setup``) builds ``KERNELS``: a new .cpp must be listed there too."""
    sources = {path.stem for path in Path(kernels.__file__).parent.glob("*.cpp")}
    assert sources == set(kernels.KERNELS)
