"""The memory a load may take (``model.memory``): the smaller of the machine's MemAvailable and
the headroom of the process's cgroups, v2 or v1, at every level up to the root, the page cache
the kernel would drop first not counted as used. Each layout is a tree of files standing in for
``/proc`` and ``/sys/fs/cgroup`` (this machine's own groups cannot be changed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from model import memory
from model.checkpoint import CheckpointError, check_size, expected_shapes
from model.config import ModelConfig

GiB = 2**30
V1_NO_LIMIT = 9223372036854771712  # what the kernel writes for none


@pytest.fixture
def system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty stand-in for /proc and /sys/fs/cgroup, a machine with 60 GiB available."""
    (tmp_path / "meminfo").write_text(
        f"MemTotal: {64 * GiB // 1024} kB\nMemAvailable: {60 * GiB // 1024} kB\n"
    )
    (tmp_path / "cgroup").mkdir()
    monkeypatch.setattr(memory, "MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(memory, "PROC_CGROUP", tmp_path / "self-cgroup")
    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path / "cgroup")
    return tmp_path


def group(folder: Path, **files: int | str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (folder / name.replace("_", ".", 1)).write_text(f"{value}\n")


def test_v2_takes_the_tightest_group_up_to_the_root_less_the_page_cache(system: Path) -> None:
    """The service's own group has no limit, its slice 3 GiB with 1 GiB used of which 0.5 GiB
    is inactive page cache: 2.5 GiB left, less than the machine's 60."""
    root = system / "cgroup"
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (system / "self-cgroup").write_text("0::/app.slice/ordinal.service\n")
    group(root / "app.slice", memory_max=3 * GiB, memory_current=GiB)
    (root / "app.slice" / "memory.stat").write_text(f"anon 1\ninactive_file {GiB // 2}\n")
    group(root / "app.slice" / "ordinal.service", memory_max="max", memory_current=GiB)
    assert memory.cgroup_headroom() == 5 * GiB // 2
    assert memory.available_memory() == 5 * GiB // 2
    assert "cgroup memory limit" in memory.where_memory_ends()


def test_v1_memory_hierarchy_beside_v2_as_systemd_mounts_it(system: Path) -> None:
    """The hybrid layout: v2 at ``unified`` without a memory controller, v1's memory controller
    at ``memory``: a 3 GiB Docker container using 2 GiB, its parent unlimited."""
    root = system / "cgroup"
    group(root / "unified")
    (root / "unified" / "cgroup.controllers").write_text("")
    (system / "self-cgroup").write_text("4:memory:/docker/abc\n0::/docker/abc\n")
    group(root / "memory", memory_limit_in_bytes=V1_NO_LIMIT, memory_usage_in_bytes=9 * GiB)
    group(root / "memory" / "docker", memory_limit_in_bytes=V1_NO_LIMIT, memory_usage_in_bytes=GiB)
    container = root / "memory" / "docker" / "abc"
    group(container, memory_limit_in_bytes=3 * GiB, memory_usage_in_bytes=2 * GiB)
    (container / "memory.stat").write_text("cache 5\ntotal_inactive_file 0\n")
    assert memory.cgroup_headroom() == GiB
    assert memory.available_memory() == GiB


def test_in_a_cgroup_namespace_the_group_is_the_mount_root(system: Path) -> None:
    """Docker's default: ``0::/`` and the container's own group mounted at the root; a usage
    past the limit (the kernel lets it, briefly) leaves nothing."""
    root = system / "cgroup"
    (root / "cgroup.controllers").write_text("memory\n")
    (system / "self-cgroup").write_text("0::/\n")
    group(root, memory_max=3 * GiB, memory_current=4 * GiB)
    assert memory.cgroup_headroom() == 0
    assert memory.available_memory() == 0


def test_a_group_not_found_under_the_mount_is_the_mount(system: Path) -> None:
    """A container that mounts its own group at the root without a namespace: its path names
    the host's hierarchy, which is not there."""
    root = system / "cgroup"
    (system / "self-cgroup").write_text("7:memory:/kubepods/pod1/abc\n")
    group(root / "memory", memory_limit_in_bytes=2 * GiB, memory_usage_in_bytes=GiB)
    assert memory.cgroup_headroom() == GiB


def test_without_a_limit_or_without_cgroups_the_machine_decides(system: Path) -> None:
    root = system / "cgroup"
    (root / "cgroup.controllers").write_text("memory\n")
    (system / "self-cgroup").write_text("0::/user.slice\n")
    group(root / "user.slice", memory_max="max", memory_current=GiB)
    assert memory.cgroup_headroom() is None
    assert memory.available_memory() == 60 * GiB
    assert "MemAvailable" in memory.where_memory_ends()
    (system / "self-cgroup").unlink()
    (system / "meminfo").unlink()
    assert memory.available_memory() is None  # not Linux: nothing known, nothing refused


def test_a_checkpoint_over_the_cgroup_limit_is_refused_naming_it(
    system: Path, tmp_path: Path
) -> None:
    """``check_size``, the engine's check before a weights file is opened: 1 MB of float32
    weights under a group with 0.5 MB left."""
    root = system / "cgroup"
    (root / "cgroup.controllers").write_text("memory\n")
    (system / "self-cgroup").write_text("0::/\n")
    group(root, memory_max=2**20, memory_current=2**19)
    config = ModelConfig(vocab_size=512, d_model=256, n_layers=1, n_heads=4, d_ff=256)
    shapes = expected_shapes(config)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"available under this process.s cgroup"):
        check_size(weights, config, shapes)
