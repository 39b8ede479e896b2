"""S3 tier specifics against a real S3 server on 127.0.0.1 (moto's)."""

from __future__ import annotations

import os
import socket

import boto3
import pytest

from kvpool.protocol.envelope import ENVELOPE_HEADER_SIZE, Codec, EnvelopeHeader, seal
from kvpool.tiers.s3 import S3Tier, object_name
from tests.kvdata import key, kv_envelope


def kv_value(n: int = 60_000, index: int = 0) -> bytes:
    return kv_envelope(n, index)


def tier_for(endpoint: str, bucket: str, **kwargs: object) -> S3Tier:
    return S3Tier(bucket, endpoint_url=endpoint, region="us-east-1", **kwargs)  # type: ignore[arg-type]


def s3(endpoint: str):  # type: ignore[no-untyped-def]
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


def test_object_names_and_codec(s3_endpoint: str, s3_bucket: str) -> None:
    tier = tier_for(s3_endpoint, s3_bucket, prefix="cache/v1", codec=Codec.SHUFFLE_LZ4)
    value = kv_value()
    assert tier.put(key(0xAB), value)
    name = object_name("cache/v1", key(0xAB))
    assert name == f"cache/v1/00/{key(0xAB).hex()}"
    stored = s3(s3_endpoint).get_object(Bucket=s3_bucket, Key=name)["Body"].read()
    assert EnvelopeHeader.unpack(stored).codec is Codec.SHUFFLE_LZ4 and len(stored) < len(value)
    assert tier.get(key(0xAB)) == value


def test_another_node_sees_what_one_wrote(s3_endpoint: str, s3_bucket: str) -> None:
    writer = tier_for(s3_endpoint, s3_bucket)
    values = {key(i): kv_value(5000, i) for i in range(25)}
    for k, v in values.items():
        assert writer.put(k, v)
    reader = tier_for(s3_endpoint, s3_bucket)
    assert not reader.contains(key(0))
    assert reader.load_index(page_size=10) == 25  # paged LIST
    assert all(reader.contains(k) for k in values)
    assert all(reader.get(k) == v for k, v in values.items())
    late = key(999)
    writer.put(late, kv_value(100))
    assert not reader.contains(late) and reader.get(late) is not None  # a GET miss asks S3


def test_list_drops_what_the_bucket_lost_and_keeps_what_changed_meanwhile(
        s3_endpoint: str, s3_bucket: str) -> None:
    tier = tier_for(s3_endpoint, s3_bucket)
    heard: list[tuple[bytes, bool]] = []
    tier.listener = lambda k, present: heard.append((k, present))
    for i in range(6):
        assert tier.put(key(i), kv_value(5000, i))
    assert heard == [(key(i), True) for i in range(6)]
    heard.clear()
    client = s3(s3_endpoint)
    client.delete_object(Bucket=s3_bucket, Key=object_name("kvpool", key(0)))  # elsewhere
    client.delete_object(Bucket=s3_bucket, Key=object_name("kvpool", key(1)))
    # after the LIST's first page (key(2), key(3)), this tier writes key(1) again and
    # deletes key(2): the LIST has not seen the one and has already seen the other, and
    # must undo neither
    paginator = tier._s3.get_paginator("list_objects_v2")
    real_paginate = paginator.paginate

    def paginate(**kwargs: object):  # type: ignore[no-untyped-def]
        for n, page in enumerate(real_paginate(**kwargs)):
            yield page
            if n == 0:
                assert tier.put(key(1), kv_value(5000, 1))
                tier.delete(key(2))

    paginator.paginate = paginate  # type: ignore[method-assign]
    tier._s3.get_paginator = lambda _name: paginator
    tier.load_index(page_size=2)
    assert [k for k in map(key, range(6)) if tier.contains(k)] == [key(1), key(3), key(4),
                                                                    key(5)]
    # key(0) left by the LIST; key(1) came back by put; delete() itself is not heard
    assert sorted(heard) == [(key(0), False), (key(1), True)]


def test_multipart_above_threshold(s3_endpoint: str, s3_bucket: str) -> None:
    tier = tier_for(s3_endpoint, s3_bucket, multipart_threshold=5 << 20, codec=Codec.RAW)
    payload = os.urandom(12 << 20)
    value = seal(payload) + payload
    assert tier.put(key(1), value)
    assert tier.get(key(1)) == value


def test_corrupt_object_is_a_miss_and_deleted(s3_endpoint: str, s3_bucket: str) -> None:
    tier = tier_for(s3_endpoint, s3_bucket, codec=Codec.RAW)
    tier.put(key(1), kv_value())
    client = s3(s3_endpoint)
    name = object_name("kvpool", key(1))
    stored = bytearray(client.get_object(Bucket=s3_bucket, Key=name)["Body"].read())
    stored[ENVELOPE_HEADER_SIZE + 999] ^= 0x02
    client.put_object(Bucket=s3_bucket, Key=name, Body=bytes(stored))
    assert tier.get(key(1)) is None
    assert tier.num_corrupt == 1 and not tier.contains(key(1))
    assert client.list_objects_v2(Bucket=s3_bucket)["KeyCount"] == 0


@pytest.mark.timeout(90)  # bounded by the deadlines, not hung: a hang fails here
def test_unreachable_s3_fails_fast_then_resumes_by_itself(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    from moto.server import ThreadedMotoServer

    # moto's credentials (the s3_endpoint fixture sets them too; this test runs alone)
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    tier = tier_for(endpoint, "kvpool-later", connect_timeout_s=0.5, read_timeout_s=1,
                    max_attempts=2)
    assert not tier.put(key(1), kv_value())
    assert tier.get(key(1)) is None
    assert tier.num_errors == 2 and (tier.last_error or "").startswith("GET")
    warnings = [r for r in caplog.records if r.name == "kvpool.tiers.s3"]
    assert len(warnings) == 1  # logged once per interval, not once per error
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        s3(endpoint).create_bucket(Bucket="kvpool-later")
        assert tier.put(key(1), kv_value())  # same tier object: nothing to reset
        assert tier.get(key(1)) is not None
    finally:
        server.stop()


@pytest.mark.parametrize("codec", list(Codec))
def test_every_codec_roundtrips(s3_endpoint: str, s3_bucket: str, codec: Codec) -> None:
    tier = tier_for(s3_endpoint, s3_bucket, codec=codec)
    value = kv_value()
    tier.put(key(5), value)
    assert tier.get(key(5)) == value
