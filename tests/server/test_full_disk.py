"""A node on a full data disk starts, serves what it holds, and takes writes again once
there is room: on a real filesystem that fills up (a small tmpfs; mounting needs root)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.client import Client
from tests.conftest import NodeProcess, node_stats, start_node

FLAGS = ("--dram-capacity", "32MiB", "--ssd-capacity", "32MiB", "--ssd-full-retry", "0.5")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"),
                                 reason="mounting a small filesystem needs root")]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(disk)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode:
        if os.environ.get("CI"):
            pytest.fail(f"cannot mount a tmpfs: {mounted.stderr}")
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk: Path) -> Path:
    filler = disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(bytes(1 << 20))
                f.flush()
        except OSError:
            pass
    return filler


def _ssd(node: NodeProcess) -> dict[str, Any]:
    ssd: dict[str, Any] = node_stats(node)["tiers"]["ssd"]
    return ssd


def _wait(predicate: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def _worker_gone(data_dir: str) -> bool:
    found = subprocess.run(["pgrep", "-f", f"ssd_worker --path {data_dir}"],
                           capture_output=True, check=False)
    return found.returncode != 0


@pytest.mark.parametrize("how", ["kill -9", "SIGTERM"])
def test_a_node_restarts_on_a_full_disk_and_recovers_when_space_returns(
        small_disk: Path, how: str) -> None:
    data_dir = str(small_disk / "node")
    values = {i.to_bytes(16, "big"): os.urandom(256 << 10) for i in range(20)}
    node = start_node(*FLAGS, data_dir=data_dir)
    try:
        with Client(node.url, shm=False) as c:  # 5 MiB: within the write-behind budget
            c.put_many(list(values), list(values.values()))
        assert _wait(lambda: _ssd(node)["num_objects"] == 20)
        filler = _fill(small_disk)
        with Client(node.url, shm=False) as c:  # a running node on the full disk serves on
            c.put(b"r" * 16, b"while full")
            assert c.get(b"r" * 16) == b"while full"
        if how == "kill -9":
            node.proc.send_signal(signal.SIGKILL)
            node.proc.wait(10)
    finally:
        assert node.stop() == 0 or how == "kill -9"
    assert _wait(lambda: _worker_gone(data_dir + "/ssd"))

    node = start_node(*FLAGS, data_dir=data_dir)  # used to exit: "No space left on device"
    try:
        assert any("is full" in line for line in node.output), "".join(node.output)
        with Client(node.url, shm=False) as c:
            assert c.get_many(list(values)) == list(values.values())  # from the SSD
            c.put(b"n" * 16, b"new while full")  # DRAM takes it
            assert c.get(b"n" * 16) == b"new while full"
            assert c.delete(next(iter(values)))  # refused by the disk: made on recovery
        assert _ssd(node)["full"]
        writes_before = _ssd(node)["writes"]
        filler.unlink()
        assert _wait(lambda: not _ssd(node)["full"]), _ssd(node)
        with Client(node.url, shm=False) as c:
            c.put(b"w" * 16, os.urandom(1 << 20))
        assert _wait(lambda: _ssd(node)["writes"] > writes_before)
    finally:
        assert node.stop() == 0
    node = start_node(*FLAGS, data_dir=data_dir)
    try:
        with Client(node.url, shm=False) as c:  # the delete made while full held
            assert c.get(next(iter(values))) is None
            assert c.get(list(values)[1]) == values[list(values)[1]]
    finally:
        node.stop()
