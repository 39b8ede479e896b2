"""A node with DRAM over the SSD tier, as a user runs it: real processes, real RocksDB."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from kvpool.client import Client
from kvpool.protocol.envelope import ENVELOPE_HEADER_SIZE, Codec
from kvpool.tiers.rocksdb import RocksDbTier
from tests.conftest import NodeProcess, http_json, start_node


def rkey() -> bytes:
    return os.urandom(16)


def ssd_stats(c: Client) -> dict[str, Any]:
    stats: dict[str, Any] = c.stats()["tiers"]["ssd"]
    return stats


def wait_for_writes(c: Client, n: int, timeout: float = 30) -> None:
    """Write-behind is asynchronous: wait (bounded) until ``n`` chunks reached the SSD."""
    deadline = time.monotonic() + timeout
    while ssd_stats(c)["writes"] < n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ssd_stats(c)["writes"] >= n, ssd_stats(c)


def test_working_set_larger_than_dram_is_served_from_ssd() -> None:
    node = start_node("--dram-capacity", "2MiB")
    try:
        with Client(node.url) as c:
            keys = [rkey() for _ in range(40)]  # 40 x 200 KB = 4x the DRAM tier
            values = [os.urandom(200_000) for _ in keys]
            for i, (k, v) in enumerate(zip(keys, values, strict=True)):
                c.put(k, v)
                wait_for_writes(c, i + 1)  # paced, so no write-behind is shed
            assert c.lookup(keys) == 40 and all(c.exists_many(keys))
            tiers = c.lookup_tiers(keys)
            assert tiers[0] == "ssd" and tiers[-1] == "dram"  # the oldest left DRAM
            assert c.exists_tiers([keys[0], keys[-1], rkey()]) == ["ssd", "dram", None]
            for k, v in zip(keys, values, strict=True):
                assert c.get(k) == v
            stats = c.stats()
            assert stats["promotions"] > 0 and stats["evictions"] > 0
            assert stats["tiers"]["ssd"]["num_objects"] == 40
            assert stats["tiers"]["dram"]["allocated_bytes"] <= 2 << 20
    finally:
        assert node.stop() == 0


def test_write_pressure_sheds_but_never_fails_or_corrupts() -> None:
    node = start_node("--dram-capacity", "2MiB")
    try:
        with Client(node.url) as c:
            keys = [rkey() for _ in range(60)]
            values = [os.urandom(200_000) for _ in keys]
            for k, v in zip(keys, values, strict=True):
                c.put(k, v)  # as fast as the client goes: never a CapacityError
            # one by one: a single GET frame can only return what fits in DRAM at once
            got = [c.get(k) for k in keys]
            assert all(g is None or g == v for g, v in zip(got, values, strict=True))
            stats = ssd_stats(c)
            served = sum(g is not None for g in got)
            assert served >= stats["writes"] > 0
            assert stats["pending_write_bytes"] <= (2 << 20) // 4
    finally:
        assert node.stop() == 0


def test_kill_9_under_write_load_then_restart() -> None:
    """Acknowledged by the SSD before the kill: served intact. Anything else: intact or a miss."""
    import threading

    node = start_node("--dram-capacity", "8MiB")
    with Client(node.url) as c:
        keys = [rkey() for _ in range(20)]
        values = [os.urandom(100_000) for _ in keys]
        c.put_many(keys, values, chunk_indexes=range(20))  # type: ignore[arg-type]
        wait_for_writes(c, 20)  # these 20 the SSD tier has acknowledged
    written: dict[bytes, bytes] = {}
    stop = threading.Event()

    def writer() -> None:
        try:
            with Client(node.url, timeout=5) as w:
                while not stop.is_set():
                    k, v = rkey(), os.urandom(200_000)
                    written[k] = v
                    w.put(k, v)
        except Exception:  # the node is killed under it
            pass

    thread = threading.Thread(target=writer)
    thread.start()
    deadline = time.monotonic() + 20
    with Client(node.url) as c:  # some of the new chunks reach the SSD, more are in flight
        while (len(written) < 30 or ssd_stats(c)["writes"] < 22) and time.monotonic() < deadline:
            time.sleep(0.01)
    node.proc.send_signal(signal.SIGKILL)  # mid-stream
    node.proc.wait(10)
    stop.set()
    thread.join(30)
    assert len(written) >= 30
    restarted = start_node("--dram-capacity", "8MiB", data_dir=node.data_dir)
    try:
        with Client(restarted.url) as c:
            assert c.get_many(keys) == values
            survivors = 0
            for k, v in written.items():
                got = c.get(k)
                assert got is None or got == v  # never bytes that were not written
                survivors += got is not None
            assert c.num_corrupt == 0
            assert survivors >= 2  # at least those the SSD had acknowledged
    finally:
        assert restarted.stop() == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_signal_to_the_group_stops_the_node_and_loses_no_queued_write_behind(
        sig: signal.Signals) -> None:
    """Ctrl-C in a terminal sends SIGINT to the node's whole process group, and a service
    manager's stop (systemd's default KillMode, `timeout`) SIGTERM to every process, the
    cold-tier worker included: the worker leaves shutting down to the node (at SIGINT it
    printed a KeyboardInterrupt traceback before; at SIGTERM it died, the node logged an
    ERROR and queued write-behinds were lost), and what was queued for the SSD is on disk."""
    node = start_node("--dram-capacity", "256MiB", own_group=True)
    values = {rkey(): os.urandom(1 << 20) for _ in range(48)}
    with Client(node.url, shm=False) as c:
        c.put_many(list(values), list(values.values()))
        stats = ssd_stats(c)
        queued = 48 - stats["writes"]
    assert stats["shed"] == 0  # 48 MiB fit the write-behind budget (a quarter of DRAM)
    # the worker gets it first (a group's processes get it in no set order): it must
    # leave stopping to the node, which still has write-behinds queued for it
    (worker,) = psutil.Process(node.proc.pid).children()
    os.kill(worker.pid, sig)
    time.sleep(0.5)
    assert worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE
    os.killpg(node.proc.pid, sig)
    assert node.proc.wait(60) == 0
    time.sleep(0.2)  # the reader thread takes the last lines
    out = "".join(node.output)
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-2000:]
    assert "ERROR" not in out, out[-2000:]
    restarted = start_node("--dram-capacity", "256MiB", data_dir=node.data_dir)
    try:
        with Client(restarted.url, shm=False) as c:
            got = c.get_many(list(values))
        missing = sum(v is None for v in got)
        assert missing == 0, f"{missing} of 48 chunks lost ({queued} were still queued)"
        assert got == list(values.values())
    finally:
        assert restarted.stop() == 0


def test_flipped_byte_on_disk_is_a_miss_never_bad_bytes(tmp_path: Path) -> None:
    node = start_node("--dram-capacity", "8MiB", "--ssd-codec", "none")
    k, v = rkey(), os.urandom(50_000)
    with Client(node.url) as c:
        c.put(k, v)
        wait_for_writes(c, 1)
    assert node.stop() == 0
    db = RocksDbTier(Path(node.data_dir) / "ssd", 256 << 20, codec=Codec.RAW)
    stored = bytearray(db._db.get(k))
    stored[ENVELOPE_HEADER_SIZE + 777] ^= 0x01
    db._db.put(k, bytes(stored))
    db.close()
    restarted = start_node("--dram-capacity", "8MiB", data_dir=node.data_dir)
    try:
        with Client(restarted.url) as c:
            assert c.exists(k)  # the index cannot know until the bytes are read
            assert c.get(k) is None
            assert ssd_stats(c)["corrupt"] == 1
            assert not c.exists(k)  # dropped where it lay
    finally:
        restarted.stop()


def test_delete_removes_from_every_tier() -> None:
    node = start_node("--dram-capacity", "8MiB")
    try:
        with Client(node.url) as c:
            k = rkey()
            c.put(k, b"x" * 1000)
            wait_for_writes(c, 1)
            assert c.delete(k)
            assert not c.exists(k) and c.get(k) is None
            assert ssd_stats(c)["num_objects"] == 0
    finally:
        node.stop()


def test_delete_overtaking_a_queued_write_behind_is_not_undone() -> None:
    """A DELETE sent while the chunks' write-behinds are still queued: when those complete,
    the chunks must not reappear on the SSD (they were once indexed on completion)."""
    node = start_node("--dram-capacity", "64MiB")
    try:
        with Client(node.url) as c:
            keys = [rkey() for _ in range(32)]
            c.put_many(keys, [os.urandom(256 << 10) for _ in keys])
            assert c.delete_many(keys) == [True] * 32
            wait_for_writes(c, 32)
            deadline = time.monotonic() + 10
            while ssd_stats(c)["pending_writes"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.exists_many(keys) == [False] * 32
            assert c.get_many(keys) == [None] * 32
            assert ssd_stats(c)["num_objects"] == 0
    finally:
        node.stop()


def test_ttl_chunks_stay_in_dram() -> None:
    node = start_node("--dram-capacity", "8MiB")
    try:
        with Client(node.url) as c:
            c.put(rkey(), b"x" * 1000, ttl=60)
            c.put(rkey(), b"y" * 1000)
            wait_for_writes(c, 1)
            time.sleep(0.2)
            assert ssd_stats(c)["writes"] == 1
    finally:
        node.stop()


def test_node_keeps_serving_dram_when_the_ssd_worker_dies(node_with_ssd: NodeProcess) -> None:
    with Client(node_with_ssd.url) as c:
        k, v = rkey(), os.urandom(10_000)
        c.put(k, v)
        wait_for_writes(c, 1)
        workers = [p for p in psutil.Process(node_with_ssd.proc.pid).children()
                   if "ssd_worker" in " ".join(p.cmdline())]
        assert len(workers) == 1
        workers[0].kill()
        workers[0].wait(10)
        deadline = time.monotonic() + 10
        while ssd_stats(c)["up"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not ssd_stats(c)["up"]
        assert c.get(k) == v  # still in DRAM
        k2 = rkey()
        c.put(k2, b"after")
        assert c.get(k2) == b"after"
        assert ssd_stats(c)["shed"] >= 1  # its write-behind was dropped, not queued forever


@pytest.fixture
def node_with_ssd():  # type: ignore[no-untyped-def]
    n = start_node("--dram-capacity", "8MiB")
    yield n
    assert n.stop() == 0


def test_no_flags_runs_dram_and_ssd(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "kvpool.server", "serve", "--data-port", "0",
                             "--admin-port", "0"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = [proc.stdout.readline() for _ in range(3)]
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    assert "DRAM tier" in lines[0] and "SSD tier" in lines[1], lines
    assert (tmp_path / "kvpool-data" / "ssd").is_dir()


@pytest.fixture
def small_disk(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A 24 MiB filesystem (tmpfs) for the SSD tier to fill up."""
    import subprocess

    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {result.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_stops_ssd_admission_and_node_keeps_serving(small_disk: Path) -> None:
    node = start_node("--dram-capacity", "128MiB", "--ssd-capacity", "1GiB",
                      data_dir=str(small_disk))
    try:
        with Client(node.url) as c:
            keys = [rkey() for _ in range(40)]  # 40 MiB: more than the 24 MiB disk
            values = [os.urandom(1 << 20) for _ in keys]
            deadline = time.monotonic() + 60
            for k, v in zip(keys, values, strict=True):
                c.put(k, v)
                while (ssd_stats(c)["pending_writes"] and time.monotonic() < deadline):
                    time.sleep(0.01)
            stats = ssd_stats(c)
            assert stats["full"] and "No space left" in stats["full"], stats
            assert 0 < stats["writes"] < 40 and stats["refused"] >= 1
            assert c.get_many(keys) == values  # every chunk still served from DRAM
            k2 = rkey()
            c.put(k2, b"after the disk filled up")
            assert c.get(k2) == b"after the disk filled up"
            assert ssd_stats(c)["shed"] >= 1  # no more writes are even sent
    finally:
        assert node.stop() == 0
    assert any("is full" in line for line in node.output), node.output  # said once, in the log


def test_events_for_ssd_evictions_ssd_only_deletes_and_expiry() -> None:
    """GET /v1/events: a chunk that leaves the SSD when DRAM no longer holds it is evicted
    (tier "ssd"); a DELETE of a chunk only the SSD holds is removed (tier "ssd"); a TTL
    that passes is expired."""
    import contextlib
    import json
    import queue
    import threading
    import urllib.request

    node = start_node("--dram-capacity", "1MiB", "--ssd-capacity", "1536KiB",
                      "--max-value", "512KiB")
    events: queue.Queue[dict[str, Any]] = queue.Queue()
    stream = urllib.request.urlopen(f"{node.admin_url}/v1/events", timeout=30)

    def read() -> None:
        for raw in stream:
            if raw.startswith(b"data: "):
                events.put(json.loads(raw[6:]))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    seen: list[dict[str, Any]] = []

    def wait_for(check: Any) -> None:
        deadline = time.monotonic() + 20
        while not check() and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                seen.append(events.get(timeout=0.1))
        assert check(), seen

    try:
        with Client(node.url) as c:
            keys = [rkey() for _ in range(10)]
            for i, k in enumerate(keys):  # 10 x 200 KiB: DRAM keeps ~5, the SSD ~7
                c.put(k, os.urandom(200 << 10))
                wait_for_writes(c, i + 1)  # one at a time: the write-behind budget is small
            wait_for(lambda: any(e["type"] == "evicted" and e["tier"] == "ssd" for e in seen))
            tiers = c.exists_tiers(keys)
            gone = {e["key"] for e in seen if e["type"] == "evicted" and e["tier"] == "ssd"}
            assert gone and all(tiers[keys.index(bytes.fromhex(h))] is None for h in gone)
            ssd_only = keys[tiers.index("ssd")]
            assert c.delete(ssd_only)
            wait_for(lambda: {"type": "removed", "key": ssd_only.hex(), "parent": None,
                              "tier": "ssd", "node": f"{node.host}:{node.port}",
                              "depth": None} in seen)
            brief = rkey()
            c.put(brief, b"short-lived", ttl=0.2)
            wait_for(lambda: any(e["type"] == "expired" and e["key"] == brief.hex()
                                 for e in seen))
            assert c.get(brief) is None
    finally:
        node.stop()  # ends the stream: the reader sees its end
        reader.join(10)
        stream.close()


def test_a_node_restarted_at_once_after_kill_9_finds_its_ssd_unlocked() -> None:
    """The SSD worker dies with its node (PDEATHSIG), so the RocksDB lock is free for a node
    restarted straight away (a supervisor's restart) and the chunks are all there."""
    node = start_node("--dram-capacity", "16MiB")
    values = [os.urandom(64 << 10) for _ in range(8)]
    keys = [bytes([i]) * 16 for i in range(8)]
    with Client(node.url, shm=False) as c:
        c.put_many(keys, values)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        _, stats = http_json(f"{node.admin_url}/v1/stats")
        if stats["tiers"]["ssd"]["num_objects"] == 8:
            break
        time.sleep(0.1)
    node.proc.send_signal(signal.SIGKILL)
    node.proc.wait(10)
    again = start_node("--dram-capacity", "16MiB", data_dir=node.data_dir)
    try:
        with Client(again.url, shm=False) as c:
            assert c.get_many(keys) == values
    finally:
        again.stop()


def test_ssd_admit_reused_writes_a_chunk_below_once_it_is_read_or_looked_up() -> None:
    """``--ssd-admit reused``: a chunk stored once and never asked for costs no flash
    write (counted as held back); one read, or only looked up, is written then; with
    the default (all) every PUT is written behind."""
    node = start_node("--dram-capacity", "8MiB", "--ssd-admit", "reused")
    try:
        with Client(node.url) as c:
            once, read, looked = rkey(), rkey(), rkey()
            for k in (once, read, looked):
                c.put(k, os.urandom(10_000))
            c.put(rkey(), os.urandom(10_000), ttl=60)  # DRAM only anyway: not held back
            assert ssd_stats(c)["held_back"] == 3 and ssd_stats(c)["writes"] == 0
            assert c.get(read) is not None
            assert c.lookup([looked]) == 1
            wait_for_writes(c, 2)
            time.sleep(0.3)  # (nothing more is coming: the third is never written)
            stats = ssd_stats(c)
            assert stats["writes"] == 2 and stats["num_objects"] == 2
            assert c.exists_tiers([read, looked]) == ["dram", "dram"]  # (a lookup of once
            assert c.get(read) is not None  # would write it) read again: not written twice
            time.sleep(0.3)
            assert ssd_stats(c)["writes"] == 2
            with urllib.request.urlopen(f"{node.admin_url}/metrics", timeout=10) as reply:
                text = reply.read().decode()
            assert 'kvpool_held_back_writes_total{tier="ssd"} 3' in text.replace(".0\n", "\n")
    finally:
        assert node.stop() == 0
    node = start_node("--dram-capacity", "8MiB")
    try:
        with Client(node.url) as c:
            c.put(rkey(), os.urandom(10_000))
            wait_for_writes(c, 1)
            assert ssd_stats(c)["held_back"] == 0
    finally:
        assert node.stop() == 0
