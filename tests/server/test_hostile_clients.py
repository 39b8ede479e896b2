"""A client can only ever hurt itself: attacks from the second hostile-test round.

Each attack is written as raw wire bytes with ``struct`` (not the project's encoder), against
a real node process; the victims are ordinary SDK clients of other tenants.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from collections.abc import Iterator

import pytest

from kvpool.client import Client
from tests.conftest import NodeProcess, http_json, start_node, tokens_file

FRAME = struct.Struct("<2sBBIIIQ")  # magic, op, status, request id, count, epoch, body_len
PUT_ITEM = struct.Struct("<16sQII")  # key, value_len, ttl_ms, flags
HELLO, PUT = 1, 2
MiB = 1 << 20

VICTIM, ATTACKER, ADMIN = ("victim-writer-0123456789", "small-writer-0123456789",
                           "ops-admin-00000123456789")


def _tokens_file(quota: str) -> str:
    return tokens_file({VICTIM: ("victim", "write"), ATTACKER: ("small", "write"),
                        ADMIN: ("ops", "admin")}, quota)


def hello_frame(token: str) -> bytes:
    body = json.dumps({"protocol": 1, "token": token}).encode()
    return FRAME.pack(b"KV", HELLO, 0, 1, 0, 0, len(body)) + body


def put_header(value_len: int, key: bytes = b"k" * 16) -> bytes:
    """A PUT frame's header and its one item header: the value itself is never sent."""
    return (FRAME.pack(b"KV", PUT, 0, 2, 1, 0, PUT_ITEM.size + value_len)
            + PUT_ITEM.pack(key, value_len, 0, 0))


def key(i: int) -> bytes:
    return b"victim-chunk" + i.to_bytes(4, "big")


@pytest.fixture
def tenant_node() -> Iterator[NodeProcess]:
    # DRAM only: an evicted chunk is gone, not moved to SSD where it would still be found
    tokens = _tokens_file('[tenant.small]\ndram_quota = "4MiB"\n')
    node = start_node("--dram-capacity", "64MiB", "--no-ssd", "--auth-tokens", tokens,
                      "--hello-timeout", "30")
    yield node
    node.stop()
    os.unlink(tokens)


def _fill_victim(node: NodeProcess) -> list[bytes]:
    values = [os.urandom(MiB) for _ in range(40)]
    with Client(node.url, token=VICTIM) as victim:
        victim.put_many([key(i) for i in range(40)], values)
    return values


def _victim_intact(node: NodeProcess, values: list[bytes]) -> int:
    with Client(node.url, token=VICTIM) as victim:
        got = victim.get_many([key(i) for i in range(len(values))])
    return sum(g == v for g, v in zip(got, values, strict=True))


def _dram_stats(node: NodeProcess) -> dict[str, int]:
    status, stats = http_json(f"{node.admin_url}/v1/stats", token=ADMIN)
    assert status == 200
    dram = stats["tiers"]["dram"]
    return {"evictions": stats["evictions"], "used": dram["used_bytes"],
            "small": stats["auth"].get("tenant_bytes", {}).get("small", {}).get("dram", 0)}


def test_unauthenticated_connections_reserve_and_evict_nothing(
        tenant_node: NodeProcess) -> None:
    values = _fill_victim(tenant_node)
    before = _dram_stats(tenant_node)
    attackers: list[socket.socket] = []
    try:
        for i in range(80):
            s = socket.create_connection((tenant_node.host, tenant_node.port), timeout=5)
            attackers.append(s)
            # no HELLO at all; a wrong token pipelined with the header; a right HELLO never sent
            s.sendall(put_header(60 * MiB) if i % 2 else
                      hello_frame("not-a-token-of-this-node") + put_header(60 * MiB))
        time.sleep(0.5)
        after = _dram_stats(tenant_node)
        assert after["evictions"] == before["evictions"]
        assert after["used"] == before["used"]
        assert _victim_intact(tenant_node, values) == 40
        with Client(tenant_node.url, token=VICTIM) as victim:  # its writes still succeed
            victim.put(key(99), b"after the attack")
            assert victim.get(key(99)) == b"after the attack"
    finally:
        for s in attackers:
            s.close()


def test_quota_holds_for_a_put_pipelined_behind_hello(tenant_node: NodeProcess) -> None:
    values = _fill_victim(tenant_node)
    with socket.create_connection((tenant_node.host, tenant_node.port), timeout=10) as s:
        s.sendall(hello_frame(ATTACKER) + put_header(24 * MiB) + bytes(24 * MiB))
        replies = b""
        # the HELLO reply, then the PUT reply: one status byte for its one item
        while replies.count(b"KV") < 2 or len(replies) < _reply_len(replies):
            chunk = s.recv(65536)
            assert chunk, "the node closed the connection"
            replies += chunk
    first = FRAME.unpack_from(replies)
    second = FRAME.unpack_from(replies, FRAME.size + first[6])
    item_status = replies[2 * FRAME.size + first[6]]
    assert second[1] == PUT and item_status != 0  # refused: over the tenant's 4 MiB quota
    stats = _dram_stats(tenant_node)
    assert stats["small"] <= 4 * MiB
    assert stats["evictions"] == 0
    assert _victim_intact(tenant_node, values) == 40


def _reply_len(data: bytes) -> int:
    """Bytes of the first two reply frames, once their headers are in."""
    if len(data) < FRAME.size:
        return FRAME.size
    first = FRAME.size + FRAME.unpack_from(data)[6]
    if len(data) < first + FRAME.size:
        return first + FRAME.size
    return first + FRAME.size + FRAME.unpack_from(data, first)[6]


@pytest.mark.slow
def test_maximal_admin_lookups_do_not_stall_other_clients(tenant_node: NodeProcess) -> None:
    """Lookups as large as the node allows (and larger) are parsed off the event loop: a
    witness's TCP GETs go on while each lookup is in flight (a 4M-token lookup once froze
    them 2-23 s: no GET completed until it was done). Checked by order of events, not by
    a bound on time: every lookup in flight for over 10 of the witness's usual GET
    intervals saw 3 GETs or more complete meanwhile (a frozen loop completes at most the
    one already in flight); the witness's own failures are the test's. bench/soak.py
    reports latencies."""
    import itertools
    import random
    import threading

    from kvpool.placement.lookup import MAX_LOOKUP_KEYS, MAX_LOOKUP_TOKENS

    rng = random.Random(5)
    tokens = [rng.randrange(50_000) for _ in range(MAX_LOOKUP_TOKENS)]
    ns = {"model": "m", "dtype": "bf16", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8}
    bodies = {
        "maximal": {"namespace": {**ns, "chunk_tokens": 256}, "tokens": tokens},
        "too many chunks": {"namespace": {**ns, "chunk_tokens": 16}, "tokens": tokens},
        "maximal keys": {"keys": [os.urandom(16).hex() for _ in range(MAX_LOOKUP_KEYS)]},
    }
    done_at: list[float] = []  # when each witness GET completed
    failures: list[BaseException] = []
    stop = threading.Event()

    def witness() -> None:
        try:
            with Client(tenant_node.url, token=VICTIM, shm=False) as c:  # TCP: the loop
                c.put(key(1), b"w" * 4096)
                while not stop.is_set():
                    if c.get(key(1)) != b"w" * 4096:
                        raise AssertionError("the witness read a wrong value")
                    done_at.append(time.monotonic())
                    time.sleep(0.002)
        except BaseException as exc:  # the test fails with it, not just this thread
            failures.append(exc)

    thread = threading.Thread(target=witness)
    thread.start()
    windows: dict[str, tuple[float, float]] = {}
    answers = {}
    try:
        while len(done_at) < 50 and thread.is_alive():  # the witness is under way
            time.sleep(0.01)
        for name, body in bodies.items():
            started = time.monotonic()
            answers[name] = http_json(f"{tenant_node.admin_url}/v1/lookup", "POST", body,
                                      VICTIM)
            windows[name] = (started, time.monotonic())
    finally:
        stop.set()
        thread.join(30)
    if failures:
        raise failures[0]
    gaps = sorted(b - a for a, b in itertools.pairwise(done_at))
    usual = gaps[len(gaps) // 2]  # the witness's usual pace
    checked = [name for name, (start, end) in windows.items()
               if end - start > 10 * usual]  # in flight across several GETs
    assert "maximal" in checked, (windows, usual)  # else this test checks nothing
    for name in checked:
        start, end = windows[name]
        # a frozen loop still completes the GET already in flight as the lookup comes in
        during = sum(start <= t <= end for t in done_at)
        assert during >= 3, f"{during} GETs completed during the {name!r} lookup"
    assert answers["maximal"][0] == 200 and answers["maximal"][1]["num_tokens"] == 0
    assert answers["too many chunks"][0] == 400
    assert "split it" in str(answers["too many chunks"][1])
    assert answers["maximal keys"][0] == 200
