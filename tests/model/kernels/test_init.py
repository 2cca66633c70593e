"""model.kernels: ``make setup`` builds every kernel source there is, and a killed build's lock
does not hang the next one: a build running elsewhere is waited for, a stale lock removed."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

import model.kernels as kernels


def test_every_kernel_source_is_built_by_build_all() -> None:
    """``build_all`` (``make setup``) builds ``KERNELS``: a new .cpp must be listed there too."""
    sources = {path.stem for path in Path(kernels.__file__).parent.glob("*.cpp")}
    assert sources == set(kernels.KERNELS)


def test_a_lock_left_by_a_killed_build_is_removed_once_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch waits on a build directory's lock forever: one left by a killed build would keep
    every later start loading for good. The wait ends when the lock is stale, and removes it."""
    monkeypatch.setattr(kernels, "STALE_LOCK_SECONDS", 0.3)
    monkeypatch.setattr(kernels, "LOCK_POLL", 0.05)
    lock = tmp_path / "lock"
    lock.touch()
    started = time.monotonic()
    kernels._wait_out_lock(tmp_path)
    assert not lock.exists()
    assert 0.3 <= time.monotonic() - started < 5  # waited for it to go stale, not for ever
    kernels._wait_out_lock(tmp_path)  # and no lock at all is fine


def test_a_build_running_elsewhere_is_waited_for_and_its_lock_left_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kernels, "LOCK_POLL", 0.05)
    lock = tmp_path / "lock"
    lock.touch()
    finished = threading.Timer(0.3, lock.unlink)  # the other build ends, removing its lock
    finished.start()
    started = time.monotonic()
    kernels._wait_out_lock(tmp_path)
    assert time.monotonic() - started >= 0.25 and not lock.exists()
    finished.join()
    old = time.time() - 10
    lock.touch()
    os.utime(lock, (old, old))  # ten seconds into a build: not stale
    waiter = threading.Thread(target=kernels._wait_out_lock, args=(tmp_path,))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and lock.exists()  # still waiting, the lock left alone
    lock.unlink()
    waiter.join(5)
    assert not waiter.is_alive()
