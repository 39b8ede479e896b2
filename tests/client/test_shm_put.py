"""Same-host puts in one round trip (COMMIT_AS, ``client/_shm_put.py``) against real node
processes: a put of the shape of the one before writes into slots that put's COMMIT_AS
held ahead, under its own keys and headers; slots of another shape, or held past half the
lease, are given back and never written; the node refuses a COMMIT_AS that does not match
its lease, or comes from a connection that may not write, and gives the lease's slots
back when it refuses one as WRONG_OWNER; tenant-scoped keys stay scoped."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

import pytest

from kvpool.cli.local_cluster import LocalCluster
from kvpool.client import AsyncClient, Client
from kvpool.client._shm_put import AHEAD_MAX_LEASES, LeasedPuts
from kvpool.protocol.envelope import ENVELOPE_HEADER_SIZE
from kvpool.protocol.errors import BadFrameError, Status, WrongOwnerError
from kvpool.protocol.frames import (
    COMMIT_AGAIN,
    Op,
    PutItemHeader,
    decode_shm_reply,
    decode_statuses,
    encode_commit_as,
)
from tests.conftest import http_json, no_loop, node_stats, shm_node, start_node, tokens_file

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

KIB = 1 << 10
PAGE = 4096


def _puts(client: Client) -> LeasedPuts:
    return shm_node(client).path.puts


def _extent(nbytes: int) -> int:
    return -(-(nbytes + ENVELOPE_HEADER_SIZE) // PAGE) * PAGE


def test_a_put_of_the_same_shape_takes_one_round_trip() -> None:
    node = start_node("--dram-capacity", "64MiB", "--no-ssd")
    try:
        sizes = [512 * KIB, 512 * KIB, 512 * KIB + 7]  # 1.5 MiB a put: through the arena
        puts = [([os.urandom(16) for _ in sizes], [os.urandom(n) for n in sizes])
                for _ in range(5)]
        parent = os.urandom(16)
        with Client(node.url, shm=True, pool_size=1) as fast, \
                Client(node.url, shm=False) as tcp:
            for i, (keys, values) in enumerate(puts):
                # headers that differ from put to put: the COMMIT_AS carries each put's own
                fast.put_many(keys, values, chunk_indexes=[i, i + 1, i + 2], num_tokens=64 * i,
                              pin=i == 3, ttl=600 if i == 2 else None,
                              parents=[parent, None, None] if i == 4 else None)
            stats = node_stats(node)
            # slots held ahead for the next put, one lease, until the client closes
            assert stats["shm"]["open_leases"] == 1
            assert stats["tiers"]["dram"]["allocated_bytes"] == 6 * sum(map(_extent, sizes))
            assert (_puts(fast).two_trips, _puts(fast).one_trip) == (1, 4)
            for keys, values in puts:
                assert tcp.get_many(keys) == values
                assert fast.get_many(keys) == values
        stats = node_stats(node)
        requests = stats["requests"]
        assert (requests["put_shm"], requests["commit_as"], requests["commit"]) == (1, 5, 0)
        shm = stats["shm"]
        assert (shm["put_leases"], shm["committed"], shm["open_leases"]) == (6, 15, 0)
        assert shm["bytes_in"] == 5 * sum(n + ENVELOPE_HEADER_SIZE for n in sizes)
        # the slots still held ahead went back when the connection closed
        assert stats["tiers"]["dram"]["allocated_bytes"] == 5 * sum(map(_extent, sizes))
        assert stats["num_objects"] == 15
        for i, (keys, _) in enumerate(puts):
            for j, key in enumerate(keys):
                chunk = http_json(f"{node.admin_url}/v1/chunks/{key.hex()}")[1]
                assert (chunk["depth"], chunk["num_tokens"]) == (i + j, 64 * i)
                assert chunk["pinned"] == (i == 3)
                assert (chunk["ttl_s"] is not None) == (i == 2)
                assert chunk["parent"] == (parent.hex() if (i, j) == (4, 0) else None)
    finally:
        assert node.stop() == 0


async def test_puts_in_flight_together_each_take_slots_held_ahead() -> None:
    node = start_node("--dram-capacity", "64MiB", "--no-ssd")
    try:
        rounds = [([os.urandom(16) for _ in range(12)], [os.urandom(256 * KIB) for _ in range(12)])
                  for _ in range(4)]
        async with AsyncClient(node.url, shm=True, pool_size=1,
                               shm_put_min_bytes=64 * KIB) as fast:
            node_client = fast._router.standalone_node
            assert node_client is not None
            puts = node_client.path.puts
            for keys, values in rounds:
                await asyncio.gather(*(fast.put(k, v) for k, v in zip(keys, values,
                                                                     strict=True)))
                # at most AHEAD_MAX_LEASES held ahead; the rest of the replies' slots released
                assert 1 <= node_stats(node)["shm"]["open_leases"] <= AHEAD_MAX_LEASES
            # after the first round, 8 of each 12 puts in flight found slots held ahead
            assert (puts.one_trip, puts.two_trips) == (3 * AHEAD_MAX_LEASES,
                                                       12 + 3 * (12 - AHEAD_MAX_LEASES))
            for keys, values in rounds:
                assert await fast.get_many(keys) == values
        for _ in range(500):  # the node sees the connection close soon after (10 s at most)
            if not node_stats(node)["shm"]["open_leases"]:
                break
            await asyncio.sleep(0.02)
        stats = node_stats(node)
        assert stats["shm"]["open_leases"] == 0 and stats["num_objects"] == 48
        assert stats["tiers"]["dram"]["allocated_bytes"] == 48 * _extent(256 * KIB)
    finally:
        assert node.stop() == 0


def test_sync_puts_through_the_arena_run_with_no_event_loop() -> None:
    node = start_node("--dram-capacity", "64MiB", "--no-ssd")
    try:
        keys = [os.urandom(16) for _ in range(6)]
        values = [os.urandom(1 << 20) for _ in keys]
        with Client(node.url, shm=True, pool_size=1) as fast, \
                Client(node.url, shm=False) as tcp:
            with no_loop(fast):
                for key, value in zip(keys[:3], values[:3], strict=True):
                    fast.put(key, value)
                fast.put_many(keys[3:], values[3:])  # another shape: the held slot goes back
            assert fast.put_bytes_by_path == {"shm": 6 << 20, "tcp": 0}
            assert (_puts(fast).two_trips, _puts(fast).one_trip) == (2, 2)
            assert tcp.get_many(keys) == values
            shm = node_stats(node)["shm"]
            assert (shm["committed"], shm["released"], shm["open_leases"]) == (6, 1, 1)
            # the blocking link's own session holds the slots ahead; a new link, none
            driver = fast._free.driver(shm_node(fast))
            assert driver.shm_write and len(driver.put_ahead) == 1
            driver.close()
            assert not driver.shm_write and not driver.put_ahead
            with no_loop(fast):
                fast.put(keys[0], values[1])
            assert tcp.get(keys[0]) == values[1]
        stats = node_stats(node)
        requests = stats["requests"]
        assert (requests["put_shm"], requests["commit_as"], requests["put"]) == (3, 5, 0)
        assert stats["shm"]["open_leases"] == 0 and stats["num_objects"] == 6
        assert stats["tiers"]["dram"]["allocated_bytes"] == 6 * _extent(1 << 20)
    finally:
        assert node.stop() == 0


def test_sync_puts_go_through_a_restarted_nodes_new_arena() -> None:
    """The node restarts on its port (a new arena): the sync client's next put, on a new
    blocking link, maps the new arena and writes through it, with no event loop."""
    node = start_node("--dram-capacity", "64MiB", "--no-ssd")
    port = node.port
    keys = [os.urandom(16) for _ in range(2)]
    values = [os.urandom(1 << 20) for _ in keys]
    try:
        with Client(node.url, shm=True, pool_size=1) as fast:
            fast.put(keys[0], values[0])
            before = shm_node(fast).path.mapping
            assert node.stop() == 0
            node = start_node("--dram-capacity", "64MiB", "--no-ssd", "--data-port", str(port))
            with no_loop(fast):
                fast.put(keys[1], values[1])
            assert fast.put_bytes_by_path == {"shm": 2 << 20, "tcp": 0}
            mapping = shm_node(fast).path.mapping
            assert mapping is not None and mapping is not before and mapping.writable
            with Client(node.url, shm=False) as tcp:
                assert tcp.get_many(keys) == [None, values[1]]
            assert fast.get(keys[1]) == values[1]
        assert node_stats(node)["shm"]["committed"] == 1
    finally:
        node.stop()


def test_slots_of_another_shape_are_given_back_unwritten() -> None:
    node = start_node("--dram-capacity", "64MiB", "--no-ssd")
    try:
        one, two = [os.urandom(1 << 20)], [os.urandom(1 << 20), os.urandom(1 << 20)]
        keys = [os.urandom(16) for _ in range(5)]
        with Client(node.url, shm=True, pool_size=1) as fast:
            fast.put_many(keys[:1], one)
            fast.put_many(keys[1:3], two)  # another shape: the held slot is released
            fast.put_many(keys[3:5], two)  # this shape again: one round trip
            assert (_puts(fast).two_trips, _puts(fast).one_trip) == (2, 1)
            assert fast.get_many(keys) == one + two + two
            shm = node_stats(node)["shm"]
            assert (shm["released"], shm["open_leases"], shm["expired"]) == (1, 1, 0)
        stats = node_stats(node)
        assert stats["requests"]["put_shm"] == 2 and stats["num_objects"] == 5
        assert stats["tiers"]["dram"]["allocated_bytes"] == 5 * _extent(1 << 20)
    finally:
        assert node.stop() == 0


def test_slots_held_past_half_the_lease_are_not_written() -> None:
    node = start_node("--dram-capacity", "64MiB", "--no-ssd", "--shm-lease", "0.6")
    try:
        keys = [os.urandom(16) for _ in range(3)]
        values = [os.urandom(1 << 20) for _ in keys]
        with Client(node.url, shm=True, pool_size=1) as fast:
            fast.put(keys[0], values[0])
            time.sleep(0.4)  # past half the lease, not yet past the lease
            fast.put(keys[1], values[1])
            time.sleep(1.0)  # past the whole lease: the node may have taken the slot back
            fast.put(keys[2], values[2])
            assert (_puts(fast).two_trips, _puts(fast).one_trip) == (3, 0)
            assert fast.get_many(keys) == values
            assert fast.put_bytes_by_path == {"shm": 3 << 20, "tcp": 0}
        stats = node_stats(node)
        assert stats["requests"]["put_shm"] == 3 and stats["shm"]["committed"] == 3
        assert stats["num_objects"] == 3
        assert stats["tiers"]["dram"]["allocated_bytes"] == 3 * _extent(1 << 20)
    finally:
        assert node.stop() == 0


def test_a_node_without_commit_as_gets_put_shm_and_commit() -> None:
    node = start_node("--dram-capacity", "64MiB", "--no-ssd")
    try:
        keys = [os.urandom(16) for _ in range(3)]
        values = [os.urandom(1 << 20) for _ in keys]
        with Client(node.url, shm=True, pool_size=1) as fast:
            shm_node(fast).path.mapping.commit_as = False  # as an older node's offer says
            for key, value in zip(keys, values, strict=True):
                fast.put(key, value)
            assert fast.get_many(keys) == values
            assert fast.put_bytes_by_path == {"shm": 3 << 20, "tcp": 0}
        requests = node_stats(node)["requests"]
        assert (requests["put_shm"], requests["commit"], requests["commit_as"]) == (3, 3, 0)
    finally:
        assert node.stop() == 0


def _raw_call(client: Client, op: Op, count: int, body: list[bytes]) -> Any:
    node = shm_node(client)

    async def call() -> Any:
        conn = await node._connection()
        return node.check(await conn.send(op, count, body))

    return client.run(call())


def test_the_node_refuses_a_commit_as_that_does_not_match_its_lease() -> None:
    node = start_node("--dram-capacity", "64MiB", "--no-ssd")
    try:
        key, other = os.urandom(16), os.urandom(16)
        head = PutItemHeader(key, ENVELOPE_HEADER_SIZE + 8192)
        with Client(node.url, shm=True, pool_size=1) as fast:
            reply = _raw_call(fast, Op.PUT_SHM, 1, [head.pack()])
            lease, slots = decode_shm_reply(reply.body, 1)
            assert lease and slots[0].length == head.value_len
            # another size than the slot's: refused, and the slot given back
            bigger = PutItemHeader(other, head.value_len + PAGE)
            with pytest.raises(BadFrameError, match="do not match the sizes"):
                _raw_call(fast, Op.COMMIT_AS, 1, [encode_commit_as(lease, 0), bigger.pack()])
        shm = node_stats(node)["shm"]
        assert (shm["put_leases"], shm["open_leases"], shm["committed"]) == (1, 0, 0)
        assert node_stats(node)["tiers"]["dram"]["allocated_bytes"] == 0
        with Client(node.url, shm=True, pool_size=1) as fast:
            # a lease this connection does not hold: NOT_FOUND, and no slots ahead either
            # when the frame asks for none; with COMMIT_AGAIN, new slots all the same
            reply = _raw_call(fast, Op.COMMIT_AS, 1, [encode_commit_as(12345, 0), head.pack()])
            assert decode_statuses(reply.body, 1) == [Status.NOT_FOUND]
            reply = _raw_call(fast, Op.COMMIT_AS, 1,
                              [encode_commit_as(12345, COMMIT_AGAIN), head.pack()])
            assert decode_statuses(reply.body[:1], 1) == [Status.NOT_FOUND]
            lease, slots = decode_shm_reply(reply.body[1:], 1)
            assert lease and slots[0].length == head.value_len
            assert fast.exists_many([key, other]) == [False, False]
            with pytest.raises(BadFrameError, match="unknown flags"):
                _raw_call(fast, Op.COMMIT_AS, 1, [encode_commit_as(lease, 2), head.pack()])
    finally:
        assert node.stop() == 0


def test_a_read_only_grant_may_not_commit_as() -> None:
    node = start_node("--dram-capacity", "16MiB", "--no-ssd", "--no-shm-write")
    try:
        head = PutItemHeader(os.urandom(16), ENVELOPE_HEADER_SIZE + 8192)
        with Client(node.url, shm=True, pool_size=1) as fast, \
                pytest.raises(BadFrameError, match="granted the arena for writing"):
            _raw_call(fast, Op.COMMIT_AS, 1, [encode_commit_as(1, COMMIT_AGAIN), head.pack()])
        shm = node_stats(node)["shm"]
        assert (shm["put_leases"], shm["open_leases"]) == (0, 0)
    finally:
        assert node.stop() == 0


def test_an_admin_of_a_tenant_puts_under_its_scoped_keys() -> None:
    path = tokens_file({"ops-admin-000123456789": ("ops", "admin"),
                        "acme-reader-0123456789": ("acme", "read")})
    node = start_node("--dram-capacity", "64MiB", "--no-ssd", "--auth-tokens", path)
    try:
        keys = [os.urandom(16) for _ in range(3)]
        values = [os.urandom(1 << 20) for _ in keys]
        with Client(node.url, token="ops-admin-000123456789", shm=True, pool_size=1) as ops:
            for key, value in zip(keys, values, strict=True):
                ops.put(key, value)
            assert (_puts(ops).two_trips, _puts(ops).one_trip) == (1, 2)
            assert ops.get_many(keys) == values
        with Client(node.url, token="ops-admin-000123456789", shm=False) as ops_tcp:
            assert ops_tcp.get_many(keys) == values
        with Client(node.url, token="acme-reader-0123456789") as acme:
            assert acme.exists_many(keys) == [False] * 3  # ops's keys, not acme's
        with Client(node.url, token="ops-admin-000123456789", scope="raw") as raw:
            assert raw.exists_many(keys) == [False] * 3  # stored under scoped keys
    finally:
        assert node.stop() == 0


def test_a_commit_as_refused_as_wrong_owner_gives_its_slots_back(tmp_path: Any) -> None:
    """A COMMIT_AS routed by an older map, for a key the node does not own, is refused
    whole; the slots of its lease go back then, not when the lease would end."""
    with LocalCluster(2, replication=1, fallbacks=0, data_dir=tmp_path,
                      serve_args=["--no-ssd", "--dram-capacity", "64MiB"]) as cluster:
        keys = [os.urandom(16) for _ in range(64)]
        owners = [prefs[0] for prefs in cluster.map.preference(keys)]
        mine, other = keys[owners.index("n0")], keys[owners.index("n1")]
        admin = f"{cluster.nodes[0].admin_url}/v1/stats"

        async def refused() -> None:
            async with AsyncClient(cluster.seeds[0], shm=True) as client:
                await client.exists_many(keys)  # connects to every node
                node = client._router.nodes["n0"]
                assert node.path.mapping is not None
                conn = await node._connection()
                head = PutItemHeader(mine, ENVELOPE_HEADER_SIZE + 8192)
                reply = node.check(await conn.send(Op.PUT_SHM, 1, [head.pack()],
                                                   epoch=cluster.map.epoch))
                lease, _ = decode_shm_reply(reply.body, 1)
                assert lease and http_json(admin)[1]["shm"]["open_leases"] == 1
                moved = PutItemHeader(other, head.value_len)
                with pytest.raises(WrongOwnerError):
                    node.check(await conn.send(Op.COMMIT_AS, 1,
                                               [encode_commit_as(lease, 0), moved.pack()],
                                               epoch=0))
                stats = http_json(admin)[1]
                assert stats["shm"]["open_leases"] == 0
                assert stats["tiers"]["dram"]["allocated_bytes"] == 0
                assert stats["wrong_owner"] == 1

        asyncio.run(refused())
