"""model.kernels: which variants a CPU runs and which one this process chooses; a build named by
its code, so checkouts never rebuild each other's; a built library loaded without a compiler;
and a killed build's lock does not hang the next one: a build running elsewhere is waited for,
a stale lock removed."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

import model.cpu as cpu
import model.kernels as kernels


def test_a_variant_is_every_source_in_one_unit(tmp_path: Path) -> None:
    """A variant compiles every .cpp here, once: a new kernel is built without being listed."""
    unity = kernels.unity_source(tmp_path).read_text()
    included = {line.split('"')[1] for line in unity.splitlines()}
    assert included == {str(path) for path in Path(kernels.__file__).parent.glob("*.cpp")}


def test_a_build_is_named_by_its_sources_and_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two checkouts of the same code share a build; any change to a source, a header or the
    flags names another, so that no checkout rebuilds another's kernels."""
    for name in ("a.cpp", "b.h"):
        (tmp_path / name).write_text("// one\n")
    monkeypatch.setattr(kernels, "HERE", tmp_path)
    first = kernels.library_name("avx2")
    assert first.startswith("ordinal_avx2_") and kernels.library_name("avx2") == first
    assert kernels.library_name("scalar") != first
    (tmp_path / "b.h").write_text("// two\n")
    second = kernels.library_name("avx2")
    assert second != first
    monkeypatch.setitem(kernels.ISA_FLAGS, "avx2", [*kernels.ISA_FLAGS["avx2"], "-mbmi2"])
    assert kernels.library_name("avx2") not in (first, second)


AVX2 = {"avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (AVX512 | {"amx_tile"}, ("avx512", "avx2", "scalar")),
        (AVX2, ("avx2", "scalar")),
        (AVX512 - {"avx512bw"}, ("avx2", "scalar")),  # AVX-512 without its 16-bit loads
        ({"sse2"}, ("scalar",)),
    ],
)
def test_the_variants_a_cpu_runs_follow_its_flags(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], expected: tuple[str, ...]
) -> None:
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv(cpu.ENVIRONMENT, raising=False)  # the run's own choice (make test-avx2)
    cpu.runnable.cache_clear()
    cpu.chosen.cache_clear()
    try:
        assert cpu.runnable() == expected
        fastest = expected[0] if expected[0] != "scalar" else None  # torch beats scalar there
        assert cpu.chosen() == fastest
        monkeypatch.setenv(cpu.ENVIRONMENT, "scalar")
        cpu.chosen.cache_clear()
        assert cpu.chosen() == "scalar"
        monkeypatch.setenv(cpu.ENVIRONMENT, "torch")  # no kernels at all
        cpu.chosen.cache_clear()
        assert cpu.chosen() is None
        for wrong in ("avx1024", "neon") + (() if "avx512" in expected else ("avx512",)):
            monkeypatch.setenv(cpu.ENVIRONMENT, wrong)
            cpu.chosen.cache_clear()
            with pytest.raises(cpu.IsaError, match=f"ORDINAL_CPU_ISA={wrong}: this CPU runs"):
                cpu.chosen()
    finally:
        cpu.runnable.cache_clear()
        cpu.chosen.cache_clear()


def test_the_flags_are_read_from_the_cpu() -> None:
    """On this machine: x86-64 runs scalar at least, and what it runs it reports."""
    if cpu.platform.machine() == "x86_64":
        assert "scalar" in cpu.runnable()
        assert ("avx2" in cpu.runnable()) == ({"avx2", "fma"} <= cpu.cpu_flags())


def test_a_built_variant_loads_without_a_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Docker image's final stage has the built libraries and no compiler: a variant whose
    library exists is loaded as it is, never handed to the builder."""
    isa = cpu.runnable()[0]
    assert kernels.ops(isa) is not None  # built (by make setup or here)
    from torch.utils import cpp_extension

    def no_compiler(*_: object, **__: object) -> None:
        raise RuntimeError("no c++ here")

    monkeypatch.setattr(cpp_extension, "_write_ninja_file_and_build_library", no_compiler)
    kernels._ops.cache_clear()
    try:
        assert kernels.ops(isa) is not None
        assert kernels.ops(isa).isa() == isa
    finally:
        kernels._ops.cache_clear()


def test_using_switches_the_variant_and_refuses_one_the_cpu_lacks() -> None:
    with kernels.using("scalar"):
        assert kernels.active() == "scalar" and kernels.ops().isa() == "scalar"
        with kernels.using(None):
            assert kernels.ops() is None
    assert kernels.active() == cpu.chosen()
    missing = next(isa for isa in ("avx512", "neon") if isa not in cpu.runnable())
    with pytest.raises(cpu.IsaError), kernels.using(missing):
        pass


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


def test_every_variant_has_its_flags_and_its_cpu_needs() -> None:
    """One list of variants: what each is compiled with (model.kernels) and what the CPU needs
    to run it (model.cpu), every architecture's variants among them."""
    assert set(kernels.ISA_FLAGS) == set(cpu.CPU_NEEDS)
    assert {isa for isas in cpu.ARCHITECTURE_ISAS.values() for isa in isas} == set(cpu.CPU_NEEDS)
