"""How much memory this process may still take: the machine's and its control group's.

A container's memory limit is its control group's (cgroup), not the machine's: MemAvailable
in ``/proc/meminfo`` reports the machine's free memory, so a process in a 3 GiB container on a
64 GB host sees 60 GB available, starts loading a 10 GB checkpoint and is killed by the kernel's
OOM killer. :func:`available_memory` is the smaller of the two headrooms:

- the machine's: ``MemAvailable``;
- the cgroup's, at every level from the process's own group up to the root (a parent's limit
  binds its children too): the limit less what the group uses, not counting the page cache the
  kernel would drop first (``inactive_file``, as ``docker stats`` and the kubelet count it).
  cgroup v2: ``memory.max``, ``memory.current`` and ``memory.stat``; v1 (the memory
  controller's own hierarchy): ``memory.limit_in_bytes``, ``memory.usage_in_bytes`` and
  ``memory.stat``'s ``total_inactive_file``.

The process's groups come from ``/proc/self/cgroup``; the hierarchies are looked for where
systemd and Docker mount them (``/sys/fs/cgroup``: v2 there, or v1 controllers under it with v2
at ``unified``). In a cgroup namespace (Docker's default) the group's path is ``/`` and its
files are at the mount's root.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

MEMINFO = Path("/proc/meminfo")
PROC_CGROUP = Path("/proc/self/cgroup")  # this process's group in each hierarchy
CGROUP_ROOT = Path("/sys/fs/cgroup")  # where the hierarchies are mounted
# A v1 limit at or above this is no limit (the kernel writes 2**63 less a page for none).
NO_LIMIT = 1 << 62


def available_memory() -> int | None:
    """Bytes of memory a new allocation may take: the smaller of the machine's MemAvailable and
    the headroom of this process's cgroups; None where neither is known (not Linux)."""
    known = [value for value in (machine_available(), cgroup_headroom()) if value is not None]
    return min(known, default=None)


def where_memory_ends() -> str:
    """What bounds :func:`available_memory` now, in words for a message."""
    group, machine = cgroup_headroom(), machine_available()
    if group is not None and (machine is None or group < machine):
        return "under this process's cgroup memory limit (its container's)"
    return "on this machine (MemAvailable)"


def machine_available() -> int | None:
    """Linux's MemAvailable, in bytes (None elsewhere)."""
    with contextlib.suppress(OSError, ValueError):
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def cgroup_headroom() -> int | None:
    """The least any of this process's cgroups (v2, or v1's memory controller), or any group
    above it, can still give it; None when no group has a memory limit."""
    headrooms = [limit - used for limit, used in (*_v2_groups(), *_v1_groups()) if limit < NO_LIMIT]
    return max(0, min(headrooms)) if headrooms else None


def _v2_groups() -> Iterator[tuple[int, int]]:
    """(limit, used) of each v2 group from this process's up, where one sets ``memory.max``."""
    for folder in _groups(_own_path(lambda controllers: controllers == ""), _v2_root()):
        limit = _read_int(folder / "memory.max")
        used = _read_int(folder / "memory.current")
        if limit is not None and used is not None:
            yield limit, used - _stat(folder, "inactive_file")


def _v1_groups() -> Iterator[tuple[int, int]]:
    """(limit, used) of each group of v1's memory controller from this process's up."""
    own = _own_path(lambda controllers: "memory" in controllers.split(","))
    for folder in _groups(own, CGROUP_ROOT / "memory"):
        limit = _read_int(folder / "memory.limit_in_bytes")
        used = _read_int(folder / "memory.usage_in_bytes")
        if limit is not None and used is not None:
            yield limit, used - _stat(folder, "total_inactive_file")


def _v2_root() -> Path:
    """Where the v2 hierarchy is mounted: the cgroup root itself, or ``unified`` below it
    (systemd's hybrid layout, v1 controllers beside it)."""
    return CGROUP_ROOT if (CGROUP_ROOT / "cgroup.controllers").exists() else CGROUP_ROOT / "unified"


def _own_path(hierarchy: Callable[[str], bool]) -> str | None:
    """This process's group in the hierarchy whose ``/proc/self/cgroup`` line's controllers
    field ``hierarchy`` accepts ("" for v2's ``0::/path``, "memory" for v1's)."""
    with contextlib.suppress(OSError):
        for line in PROC_CGROUP.read_text().splitlines():
            fields = line.split(":", 2)  # id:controllers:path
            if len(fields) == 3 and hierarchy(fields[1]):
                return fields[2]
    return None


def _groups(path: str | None, root: Path) -> Iterator[Path]:
    """The folder of group ``path`` under ``root`` and every folder above it, up to ``root``.
    A path not found under the mount (a container that mounts its own group there without a
    cgroup namespace) is the mount itself."""
    if path is None or not root.is_dir():
        return
    folder = root / path.lstrip("/")
    if not folder.is_dir():
        folder = root
    while True:
        yield folder
        if folder == root or not folder.is_relative_to(root):
            return
        folder = folder.parent


def _read_int(path: Path) -> int | None:
    """The number in ``path`` ("max", v2's no limit, reads as one past any limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return NO_LIMIT
    try:
        return int(text)
    except ValueError:
        return None


def _stat(folder: Path, key: str) -> int:
    """``key``'s value in the group's ``memory.stat`` (0 when it is not there)."""
    with contextlib.suppress(OSError, ValueError):
        for line in (folder / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0
