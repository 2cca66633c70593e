"""model.kernels: ``make setup`` builds every kernel source there is, and a killed build's lock
does not hang the next one."""

from __future__ import annotations

import os
import time
from pathlib import Path

import model.kernels as kernels


def test_every_kernel_source_is_built_by_build_all() -> None:
    """``build_all`` (``make setup``) builds ``KERNELS``: a new .cpp must be listed there too."""
    sources = {path.stem for path in Path(kernels.__file__).parent.glob("*.cpp")}
    assert sources == set(kernels.KERNELS)


def test_a_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path: Path) -> None:
    """torch waits on a build directory's lock forever: one left by a killed build would hang
    every later start (the engine's watchdog then kills it, and so on)."""
    lock = tmp_path / "lock"
    lock.touch()
    kernels._clear_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running now
    old = time.time() - kernels.STALE_LOCK_SECONDS - 1
    os.utime(lock, (old, old))
    kernels._clear_stale_lock(tmp_path)
    assert not lock.exists()
    kernels._clear_stale_lock(tmp_path)  # and no lock at all is fine
