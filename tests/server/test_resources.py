"""What a node takes from its machine: the memory a container's cgroup lets it use."""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from kvpool.server.memory import cgroup_memory, memory_limit
from kvpool.server.resources import memory_room

GiB = 1 << 30


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_v2_limit_on_a_parent_cgroup_applies_less_the_cache_the_kernel_reclaims(
        tmp_path: Path) -> None:
    root = tree(tmp_path / "cg", {
        "memory.max": "max\n",
        "kubepods/memory.max": "8589934592\n",  # 8 GiB on the pod
        "kubepods/memory.current": str(3 * GiB),
        "kubepods/memory.stat": f"anon 1000\ninactive_file {GiB}\nactive_file 5\n",
        "kubepods/app/memory.max": "max\n",  # none on the container itself
    })
    me = tree(tmp_path, {"self": "0::/kubepods/app\n"}) / "self"
    assert cgroup_memory(root, me) == (8 * GiB, 2 * GiB)


def test_a_v1_container_sees_its_own_limit_at_the_hierarchy_root(tmp_path: Path) -> None:
    """Docker on cgroup v1: /proc/self/cgroup names the host's path (/docker/<id>), which
    is not mounted inside; the container's cgroup is the root of its memory mount."""
    root = tree(tmp_path / "cg", {
        "memory/memory.limit_in_bytes": str(4 * GiB),
        "memory/memory.usage_in_bytes": str(GiB),
        "memory/memory.stat": "cache 10\ntotal_inactive_file 0\n",
    })
    me = tree(tmp_path, {"self": "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n"})
    assert cgroup_memory(root, me / "self") == (4 * GiB, GiB)


def test_no_limit_is_none(tmp_path: Path) -> None:
    root = tree(tmp_path / "cg", {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",  # what v1 says for none
        "memory.max": "max\n",
    })
    me = tree(tmp_path, {"self": "4:memory:/x\n0::/x\n"}) / "self"
    assert cgroup_memory(root, me) is None
    tree(root, {"x/memory.max": "garbage\n"})  # read as no limit, not an error at start
    assert cgroup_memory(root, me) is None
    assert cgroup_memory(root, tmp_path / "no-such-file") is None


def test_the_memory_a_node_may_use_is_never_more_than_the_machines() -> None:
    total, available = memory_room()
    machine = psutil.virtual_memory()
    assert 0 < total <= machine.total
    assert 0 <= available <= total
    assert 0 < memory_limit() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
