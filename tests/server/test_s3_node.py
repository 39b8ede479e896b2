"""Nodes with an S3 tier: a chunk survives the loss of the node that wrote it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import boto3
import psutil
import pytest

from kvpool.client import Client
from kvpool.protocol.envelope import seal
from kvpool.tiers.s3 import object_name
from tests.conftest import start_node

pytestmark = pytest.mark.slow  # nodes over a real S3 server, outages and restarts


@pytest.fixture(autouse=True)
def aws_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Test credentials for boto3 here and in the nodes (which inherit the environment),
    also in the tests that start moto servers of their own: they ran only after a test
    that used the session's server had set them."""
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, os.environ.get(name, value))


def tier_stats(c: Client, tier: str) -> dict[str, Any]:
    stats: dict[str, Any] = c.stats()["tiers"].get(tier, {})
    return stats


def wait_until(check: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert check()


@pytest.mark.parametrize("admit", ["all", "reused"])
def test_chunk_survives_the_node_that_wrote_it(s3_endpoint: str, s3_bucket: str,
                                               admit: str) -> None:
    """... and the reader writes what it fetched to its SSD: a GET is a read, reuse
    enough for ``--ssd-admit reused`` too."""
    s3_flags = ("--s3-bucket", s3_bucket, "--s3-endpoint", s3_endpoint, "--s3-region",
                "us-east-1")
    writer = start_node("--dram-capacity", "16MiB", *s3_flags)
    keys = [os.urandom(16) for _ in range(10)]
    values = [os.urandom(300_000) for _ in keys]
    with Client(writer.url) as c:
        c.put_many(keys, values, chunk_indexes=range(10))  # type: ignore[arg-type]
        wait_until(lambda: tier_stats(c, "s3").get("insertions", 0) >= 10)
    worker = psutil.Process(writer.proc.pid).children()
    writer.proc.send_signal(signal.SIGKILL)  # the writer and its disk are gone
    writer.proc.wait(10)
    _, alive = psutil.wait_procs(worker, timeout=30)
    assert not alive  # its SSD worker never outlives it
    shutil.rmtree(writer.data_dir)
    reader = start_node("--dram-capacity", "16MiB", "--ssd-admit", admit, *s3_flags)
    try:
        with Client(reader.url) as c:
            wait_until(lambda: c.lookup(keys) == 10)  # its LIST found them
            assert c.lookup_tiers(keys) == ["s3"] * 10
            assert c.get_many(keys) == values
            later = os.urandom(16)  # written by another node after this one's LIST
            boto3.client("s3", endpoint_url=s3_endpoint).put_object(
                Bucket=s3_bucket, Key=object_name("kvpool", later),
                Body=seal(b"late chunk") + b"late chunk")
            assert c.lookup([later]) == 0  # LOOKUP stays local: no round trip to S3
            assert c.get(later) == b"late chunk"  # a GET miss asks S3
            assert c.stats()["promotions"] == 11
            wait_until(lambda: tier_stats(c, "ssd")["writes"] >= 10)  # and now on its SSD
            assert c.delete(keys[0])
            wait_until(lambda: boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(
                Bucket=s3_bucket)["KeyCount"] == 10)  # 9 left + the late one
    finally:
        assert reader.stop() == 0


def test_s3_outage_does_not_touch_dram_and_ssd_and_recovers() -> None:
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"

    def s3_up() -> ThreadedMotoServer:
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket="kvpool-outage")
        return server

    server = s3_up()
    node = start_node("--dram-capacity", "16MiB", "--s3-bucket", "kvpool-outage",
                      "--s3-endpoint", endpoint, "--s3-region", "us-east-1")
    try:
        with Client(node.url) as c:
            c.put(os.urandom(16), os.urandom(100_000))
            wait_until(lambda: tier_stats(c, "s3").get("insertions", 0) >= 1)
            server.stop()
            keys = [os.urandom(16) for _ in range(5)]
            values = [os.urandom(100_000) for _ in keys]
            c.put_many(keys, values)
            assert c.get_many(keys) == values  # DRAM, unaffected
            wait_until(lambda: tier_stats(c, "ssd")["writes"] >= 6)  # SSD, unaffected
            wait_until(lambda: tier_stats(c, "s3").get("errors", 0) >= 1, timeout=60)
            server = s3_up()  # S3 is back: nothing to restart on the node
            k = os.urandom(16)
            c.put(k, b"after the outage")
            wait_until(lambda: tier_stats(c, "s3").get("insertions", 0) >= 2, timeout=60)
    finally:
        node.stop()
        server.stop()


@pytest.mark.parametrize("below", [(), ("--no-ssd",)], ids=["ssd-and-s3", "s3-alone"])
def test_write_through_acknowledges_only_what_s3_holds(below: tuple[str, ...]) -> None:
    from moto.server import ThreadedMotoServer

    from kvpool.client import NotDurableError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    bucket = f"kvpool-through-{os.urandom(4).hex()}"  # moto's buckets outlive its server
    s3.create_bucket(Bucket=bucket)
    node = start_node("--dram-capacity", "16MiB", "--s3-bucket", bucket,
                      "--s3-endpoint", endpoint, "--s3-region", "us-east-1",
                      "--s3-write-through", *below)
    try:
        with Client(node.url, timeout=60) as c:
            keys = [os.urandom(16) for _ in range(3)]
            c.put_many(keys, [os.urandom(50_000) for _ in keys])
            names = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
            assert names == {object_name("kvpool", k) for k in keys}  # no waiting needed
            server.stop()
            k = os.urandom(16)
            with pytest.raises(NotDurableError) as info:
                c.put(k, b"while S3 is down")
            assert k.hex() in str(info.value)
            assert c.get(k) == b"while S3 is down"  # cached all the same
    finally:
        node.stop()
        server.stop()


def test_index_drops_a_chunk_deleted_from_s3_by_someone_else(s3_endpoint: str,
                                                             s3_bucket: str) -> None:
    """Another node's DELETE (here: a bare one) reaches this node's LOOKUP at its next LIST,
    instead of this node reporting the chunk in S3 until a GET of it misses."""
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    node = start_node("--dram-capacity", "16MiB", "--s3-bucket", s3_bucket, "--s3-endpoint",
                      s3_endpoint, "--s3-region", "us-east-1", "--s3-relist", "0.2")
    try:
        with Client(node.url) as c:
            k = os.urandom(16)
            s3.put_object(Bucket=s3_bucket, Key=object_name("kvpool", k),
                          Body=seal(b"from elsewhere") + b"from elsewhere")
            wait_until(lambda: c.lookup_tiers([k]) == ["s3"])  # a LIST found it
            s3.delete_object(Bucket=s3_bucket, Key=object_name("kvpool", k))
            wait_until(lambda: c.lookup([k]) == 0)  # and a later LIST found it gone
            assert c.get(k) is None
    finally:
        assert node.stop() == 0


def test_a_deleted_chunk_never_comes_back_in_lookups(s3_endpoint: str, s3_bucket: str) -> None:
    """A DELETE right after the write-behind upload: the upload's PRESENT record, logged by
    the worker before the DELETE, reaches the node after it and must not bring it back."""
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    node = start_node("--dram-capacity", "16MiB", "--s3-bucket", s3_bucket, "--s3-endpoint",
                      s3_endpoint, "--s3-region", "us-east-1")
    try:
        with Client(node.url) as c:
            keys = [os.urandom(16) for _ in range(8)]
            for k in keys:
                c.put(k, os.urandom(50_000))
                # deleted as soon as S3 has it: before the node's next poll of the worker's
                # log (every second) picks up the upload
                wait_until(lambda k=k: "Contents" in s3.list_objects_v2(
                    Bucket=s3_bucket, Prefix=object_name("kvpool", k)), timeout=10)
                assert c.delete(k)
            kept = os.urandom(16)
            c.put(kept, b"kept")
            wait_until(lambda: tier_stats(c, "s3").get("insertions", 0) >= 9)
            time.sleep(2.5)  # two polls of the worker's log
            assert c.lookup_tiers(keys) == []
            assert c.exists_tiers(keys) == [None] * 8
            assert tier_stats(c, "s3")["keys_known"] == 1  # only `kept`
            assert s3.list_objects_v2(Bucket=s3_bucket)["KeyCount"] == 1
            c.put(keys[0], b"written again")  # after its DELETE: known to be in S3 again
            wait_until(lambda: tier_stats(c, "s3")["keys_known"] == 2)
    finally:
        assert node.stop() == 0


def test_evicting_the_ssd_tier_keeps_the_s3_copies(s3_endpoint: str, s3_bucket: str) -> None:
    """POST /v1/admin/evict {"tier": "ssd"} drops this node's SSD copies; S3, which the
    whole cluster shares, keeps its own, and a GET is served from there."""
    import json
    import urllib.request

    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    node = start_node("--dram-capacity", "16MiB", "--s3-bucket", s3_bucket, "--s3-endpoint",
                      s3_endpoint, "--s3-region", "us-east-1")

    def evict(tier: str) -> Any:
        request = urllib.request.Request(f"{node.admin_url}/v1/admin/evict", method="POST",
                                         data=json.dumps({"tier": tier}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            return json.loads(reply.read())

    try:
        with Client(node.url) as c:
            k, value = os.urandom(16), os.urandom(100_000)
            c.put(k, value)
            wait_until(lambda: tier_stats(c, "s3").get("keys_known", 0) == 1)  # uploaded
            assert evict("ssd") == {"evicted": {"dram": 0, "ssd": 1}}
            assert evict("dram") == {"evicted": {"dram": 1, "ssd": 0}}
            assert c.exists_tiers([k]) == ["s3"]
            assert s3.list_objects_v2(Bucket=s3_bucket)["KeyCount"] == 1
            assert c.get(k) == value  # fetched back from S3
    finally:
        assert node.stop() == 0


def test_write_through_asks_s3_before_acking_a_chunk_its_index_lists(
        s3_endpoint: str, s3_bucket: str) -> None:
    """A write-through PUT of a chunk the node's index says S3 has is acked only if S3 says
    so too: another node may have deleted it since this node's last LIST (60 s here)."""
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    node = start_node("--dram-capacity", "16MiB", "--s3-bucket", s3_bucket, "--s3-endpoint",
                      s3_endpoint, "--s3-region", "us-east-1", "--s3-write-through")
    try:
        with Client(node.url, timeout=60) as c:
            k, value = os.urandom(16), os.urandom(50_000)
            c.put(k, value)
            wait_until(lambda: tier_stats(c, "s3").get("keys_known", 0) == 1)  # the index
            s3.delete_object(Bucket=s3_bucket, Key=object_name("kvpool", k))  # elsewhere
            c.put(k, value)  # acked durable: S3 must have it again
            assert s3.list_objects_v2(Bucket=s3_bucket)["KeyCount"] == 1
            c.put(k, value)  # and now the index is right: no second upload
            assert tier_stats(c, "s3")["insertions"] == 2
    finally:
        assert node.stop() == 0


def test_s3_right_below_dram_with_no_ssd_tier(s3_endpoint: str, s3_bucket: str) -> None:
    """``--no-ssd`` with a bucket: DRAM over S3 alone. Every write-behind is an upload;
    chunks DRAM evicted come back from S3; nothing is written to the local disk."""
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    node = start_node("--no-ssd", "--dram-capacity", "8MiB", "--s3-bucket", s3_bucket,
                      "--s3-endpoint", s3_endpoint, "--s3-region", "us-east-1")
    keys = [os.urandom(16) for _ in range(40)]
    values = [os.urandom(300_000) for _ in keys]  # 12 MB: more than DRAM holds
    try:
        with Client(node.url) as c:
            for start in range(0, len(keys), 5):  # paced: uploads are slower than PUTs
                c.put_many(keys[start : start + 5], values[start : start + 5])
                wait_until(lambda n=start + 5: tier_stats(c, "s3").get("keys_known", 0) >= n)
            tiers = c.stats()["tiers"]
            assert "ssd" not in tiers
            assert tiers["s3"]["node"]["shed"] == 0 and tiers["s3"]["node"]["up"]
            assert tiers["s3"]["node"]["writes"] == 40
            held = c.lookup_tiers(keys)
            assert len(held) == 40 and "s3" in held and held[-1] == "dram"  # evicted: in S3
            assert c.get_many(keys) == values  # promoted back from S3 where DRAM lost them
            assert c.stats()["promotions"] >= held.count("s3")
            assert s3.list_objects_v2(Bucket=s3_bucket)["KeyCount"] == 40
            assert c.delete(keys[0])
            wait_until(lambda: s3.list_objects_v2(Bucket=s3_bucket)["KeyCount"] == 39)
        table = subprocess.run([sys.executable, "-m", "kvpool.cli", "stats", "--admin",
                                node.admin_url], capture_output=True, text=True, timeout=60,
                               check=True)
        assert "S3 objects known (right below DRAM)" in table.stdout
        assert "SSD" not in table.stdout
        assert not os.path.exists(os.path.join(node.data_dir, "ssd"))  # no RocksDB here
    finally:
        assert node.stop() == 0


def test_a_chunk_stored_with_a_ttl_takes_its_keys_copy_out_of_s3(s3_endpoint: str,
                                                                  s3_bucket: str) -> None:
    """A TTL chunk lives in DRAM only; an older copy of its key below (here in S3, with no
    SSD tier) is deleted, so the key cannot come back from S3 once the TTL has passed."""
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    node = start_node("--no-ssd", "--dram-capacity", "8MiB", "--s3-bucket", s3_bucket,
                      "--s3-endpoint", s3_endpoint, "--s3-region", "us-east-1")
    try:
        with Client(node.url) as c:
            k = os.urandom(16)
            c.put(k, b"old value")
            wait_until(lambda: s3.list_objects_v2(Bucket=s3_bucket)["KeyCount"] == 1)
            c.put(k, b"short-lived", ttl=0.5)
            wait_until(lambda: s3.list_objects_v2(Bucket=s3_bucket)["KeyCount"] == 0)
            time.sleep(0.6)
            assert c.get(k) is None  # gone: not the old value promoted back from S3
    finally:
        assert node.stop() == 0


def test_with_s3_alone_a_write_the_budget_sheds_is_counted_and_exported(
        s3_endpoint: str, s3_bucket: str) -> None:
    """With no SSD, a chunk the write-behind budget sheds lives in DRAM only until evicted:
    /v1/stats and /metrics say how many (as S3's shed writes)."""
    import urllib.request

    node = start_node("--no-ssd", "--dram-capacity", "8MiB", "--ssd-max-pending", "1MiB",
                      "--s3-bucket", s3_bucket, "--s3-endpoint", s3_endpoint,
                      "--s3-region", "us-east-1")
    try:
        with Client(node.url) as c:
            keys = [os.urandom(16) for _ in range(8)]
            c.put_many(keys, [os.urandom(300_000) for _ in keys])  # 2.4 MB in one frame
            s3 = tier_stats(c, "s3")
            assert s3["shed"] == s3["node"]["shed"] >= 4  # at most 3 fit 1 MiB in flight
            wait_until(lambda: tier_stats(c, "s3")["node"]["pending_writes"] == 0)
            stored = tier_stats(c, "s3")["node"]["writes"]
            assert stored + s3["shed"] == 8
        with urllib.request.urlopen(f"{node.admin_url}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        assert f'kvpool_shed_writes_total{{tier="s3"}} {s3["shed"]}' in text.replace(".0\n", "\n")
    finally:
        assert node.stop() == 0
