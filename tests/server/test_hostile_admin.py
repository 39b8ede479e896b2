"""Hostile callers of the admin port, against real nodes: bodies that nest or weigh too
much, event streams that outlive their token or never read, floods of idle connections.

The promise (docs/operations.md): bad input gets a 4xx with a JSON error body, never a
5xx or a traceback; the admin side can never starve the data path.
"""

from __future__ import annotations

import http.client
import json
import os
import resource
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from kvpool.client import Client
from tests.conftest import NodeProcess, http_json, start_node, tokens_file

NESTED = b"[" * 1000 + b"]" * 1000  # 2 KB, 1,000 deep
ADMIN = "admin-token-of-the-tests"
WRITER = "writer-token-of-the-tests"


@pytest.fixture(scope="module")
def node() -> Iterator[NodeProcess]:
    n = start_node("--dram-capacity", "64MiB", "--no-ssd")
    yield n
    n.stop()


def admin_address(node: NodeProcess) -> tuple[str, int]:
    parts = urlsplit(node.admin_url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def raw_request(node: NodeProcess, method: str, path: str, body: bytes, *,
                length: int | None = None, token: str = "") -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 request written by hand (a Content-Length that
    need not match the body: what a hostile caller sends)."""
    head = [f"{method} {path} HTTP/1.1", "Host: kvpool", "Connection: close",
            "Content-Type: application/json",
            f"Content-Length: {len(body) if length is None else length}"]
    if token:
        head.append(f"Authorization: Bearer {token}")
    with socket.create_connection(admin_address(node), timeout=30) as s:
        # (a short body is not followed by a half-close: the node would drop the connection)
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        reply = http.client.HTTPResponse(s)  # read by its length: the node may linger
        reply.begin()
        return reply.status, reply.read()


def json_error(body: bytes) -> dict[str, str]:
    error: dict[str, str] = json.loads(body)["error"]
    assert "Traceback" not in error["message"] and "File \"" not in error["message"]
    return error


@pytest.mark.parametrize("path", ["/v1/lookup", "/v1/admin/evict", "/v1/cluster/join"])
def test_a_body_nested_1000_deep_is_a_400_with_a_json_error(node: NodeProcess,
                                                            path: str) -> None:
    status, body = raw_request(node, "POST", path, NESTED)
    assert status == 400, body
    assert "nests" in json_error(body)["message"]


def test_a_large_nested_lookup_is_a_400_without_the_parsers_traceback(node: NodeProcess
                                                                      ) -> None:
    """Over 64 KiB a lookup is parsed in a child process: its failure is a 400 that says
    what was wrong, not the child's traceback."""
    deep = b'{"keys": ' + b"[" * 40_000 + b"]" * 40_000 + b"}"
    status, body = raw_request(node, "POST", "/v1/lookup", deep)
    assert status == 400, body
    json_error(body)
    junk = b'{"keys": ["' + b"\xff" * 100_000 + b'"]}'  # not UTF-8
    status, body = raw_request(node, "POST", "/v1/lookup", junk)
    assert status == 400, body
    json_error(body)


@pytest.mark.parametrize(("path", "length"), [("/v1/lookup", 70 << 20),
                                              ("/v1/admin/evict", 100 << 10),
                                              ("/v1/cluster/join", 100 << 10)])
def test_an_oversized_body_is_a_413_with_a_json_error(node: NodeProcess, path: str,
                                                      length: int) -> None:
    status, body = raw_request(node, "POST", path, b"{}", length=length)
    assert status == 413, body
    assert json_error(body)["type"] == "payload_too_large"


def test_the_node_still_serves_after_the_bad_bodies(node: NodeProcess) -> None:
    assert http_json(node.admin_url + "/healthz")[0] == 200
    with Client(node.url) as kv:
        kv.put(b"k" * 16, b"value")
        assert kv.get(b"k" * 16) == b"value"


# -- the events stream ----------------------------------------------------------------------

def open_events(node: NodeProcess, token: str = "") -> socket.socket:
    s = socket.create_connection(admin_address(node), timeout=10)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    s.sendall(f"GET /v1/events HTTP/1.1\r\nHost: kvpool\r\n{auth}\r\n".encode())
    return s


def read_until_closed(s: socket.socket, seconds: float) -> bytes:
    """What the node sends before it closes the stream (fails if it stays open)."""
    s.settimeout(seconds)
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except TimeoutError:
        pytest.fail(f"the stream was still open after {seconds}s: {got[-300:]!r}")
    except ConnectionResetError:
        pass  # aborted by the node
    return got


def test_a_revoked_tokens_event_stream_is_closed_on_reload(tmp_path: Path) -> None:
    path = tokens_file({ADMIN: ("ops", "admin"), WRITER: ("acme", "write")})
    node = start_node("--dram-capacity", "16MiB", "--no-ssd", "--auth-tokens", path)
    try:
        stream = open_events(node, ADMIN)
        stream.settimeout(5)
        assert b"200 OK" in stream.recv(4096)
        Path(path).write_text(Path(tokens_file({WRITER: ("acme", "write")}))
                              .read_text())
        node.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        with Client(node.url, token=WRITER) as kv:  # the data path still works
            kv.put(os.urandom(16), b"after the reload")
        rest = read_until_closed(stream, 5)
        assert b"stored" not in rest  # no event reached a stream whose token is gone
        stream.close()
    finally:
        node.stop()


def test_events_need_the_admin_token_when_a_node_has_only_an_admin_token() -> None:
    node = start_node("--dram-capacity", "16MiB", "--no-ssd", "--admin-token", ADMIN)
    try:
        status, body = raw_request(node, "GET", "/v1/events", b"")
        assert status == 401, body
        assert http_json(node.admin_url + "/v1/stats")[0] == 200  # reads stay open
        stream = open_events(node, ADMIN)
        stream.settimeout(5)
        assert b"200 OK" in stream.recv(4096)
        stream.close()
    finally:
        node.stop()


def test_a_subscriber_that_never_reads_is_dropped(node: NodeProcess) -> None:
    """Its socket takes what its buffers hold, then its queue fills: the node drops it,
    counts it, and stops paying for it; another subscriber that reads is kept."""
    silent = socket.socket()
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    silent.connect(admin_address(node))
    silent.sendall(b"GET /v1/events?types=stored HTTP/1.1\r\nHost: kvpool\r\n\r\n")
    time.sleep(0.3)
    before = http_json(node.admin_url + "/v1/stats")[1]["events"]
    assert before["subscribers"] == 1
    value = b"v" * 64
    with Client(node.url) as kv:
        for round_ in range(80):  # 80,000 stored events: several queues' worth
            keys = [os.urandom(16) for _ in range(1000)]
            kv.put_many(keys, [value] * len(keys))
            if round_ % 10 == 9:
                events = http_json(node.admin_url + "/v1/stats")[1]["events"]
                if events["dropped"] > before["dropped"]:
                    break
    events = http_json(node.admin_url + "/v1/stats")[1]["events"]
    assert events["dropped"] == before["dropped"] + 1
    assert events["subscribers"] == 0
    silent.close()


# -- idle connections and descriptors -------------------------------------------------------

def test_an_admin_flood_never_closes_a_tenants_data_connection() -> None:
    """The node's descriptor limit set to twice --max-connections, then 600 admin
    connections that never send a byte: the admin port keeps its cap, a data connection
    opened before and one opened during the flood both work, and the idle admin
    connections are closed after --admin-idle-timeout."""
    node = start_node("--dram-capacity", "16MiB", "--no-ssd", "--max-connections", "64",
                      "--admin-max-connections", "16", "--admin-idle-timeout", "2")
    flood: list[socket.socket] = []
    try:
        resource.prlimit(node.proc.pid, resource.RLIMIT_NOFILE, (128, 128))
        with Client(node.url, shm=False) as before:
            before.put(b"a" * 16, b"before the flood")
            for _ in range(600):
                try:
                    flood.append(socket.create_connection(admin_address(node), timeout=5))
                except OSError:
                    break
            time.sleep(0.5)
            with Client(node.url, shm=False) as during:
                during.put(b"b" * 16, b"during the flood")
                assert during.get(b"a" * 16) == b"before the flood"
            assert before.get(b"b" * 16) == b"during the flood"
        closed = 0
        deadline = time.monotonic() + 10
        for s in flood:  # refused at once, or closed once idle for 2 s
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                closed += s.recv(1) == b""
            except OSError:
                closed += 1
        assert closed == len(flood)
        assert http_json(node.admin_url + "/healthz")[0] == 200
        assert not any("Too many open files" in line for line in node.output)
    finally:
        for s in flood:
            s.close()
        node.stop()
