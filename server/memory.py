"""The memory a node may use: the machine's, within its container's cgroup limit.

Read with no third-party library (the command line checks ``cluster up``'s DRAM against
it before any node dependency is imported).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cgroup_memory", "memory_limit", "within_limit"]

#: a cgroup v1 limit at or above this is "no limit" (the kernel writes ~2^63)
_NO_LIMIT = 1 << 60


def cgroup_memory(root: Path = Path("/sys/fs/cgroup"),
                  self_cgroup: Path = Path("/proc/self/cgroup")) -> tuple[int, int] | None:
    """The tightest memory limit on this process's cgroup or a parent of it, and that
    cgroup's use less its inactive file cache (what the kernel reclaims first, as
    ``docker stats`` and the kubelet count): ``(limit, used)`` in bytes; None where no
    limit applies (or none can be read). cgroup v2 (``memory.max``) and v1
    (``memory.limit_in_bytes``), the process's own path first, then its parents, then the
    hierarchy's root (a container sees its own cgroup there)."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    found: list[tuple[int, int]] = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: "0::/path"
            base, limit_file, use_file = root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base = root / "memory"
            limit_file, use_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            folder = base.joinpath(*parts[:depth])
            try:
                limit_text = (folder / limit_file).read_text().strip()
            except OSError:
                continue
            if not limit_text.isdigit() or int(limit_text) >= _NO_LIMIT:
                continue  # "max" (v2's none), or nothing this reads as a limit
            try:
                used = int((folder / use_file).read_text())
                stat = dict(row.split() for row in (folder / "memory.stat").read_text()
                            .splitlines() if row.count(" ") == 1)
                used -= int(stat.get("inactive_file", stat.get("total_inactive_file", 0)))
            except (OSError, ValueError):
                used = 0
            found.append((int(limit_text), max(used, 0)))
    return min(found) if found else None


def within_limit(total: int, available: int) -> tuple[int, int]:
    """The machine's ``total`` and ``available`` memory, within this process's cgroup
    limit where one applies (available: what the limit leaves of it now)."""
    cgroup = cgroup_memory()
    if cgroup is None:
        return total, available
    limit, used = cgroup
    return min(total, limit), min(available, max(limit - used, 0))


def memory_limit() -> int:
    """The most memory this host lets a process use: its physical memory, or less where a
    cgroup limit applies."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return within_limit(physical, physical)[0]
