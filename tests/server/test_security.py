"""Auth, roles and tenant isolation against real node processes (tokens file, SIGHUP, S3)."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.client import (
    AuthenticationError,
    Client,
    KvpoolConnectionError,
    PermissionDeniedError,
)
from kvpool.protocol.envelope import seal
from kvpool.protocol.frames import FrameHeader, Op, PutItemHeader, encode_frame, encode_json
from kvpool.server.security.auth import load_tokens, scope_key
from tests.conftest import NodeProcess, http_json, start_node, tokens_file

TOKENS = {
    "acme-writer-0123456789": ("acme", "write"),
    "acme-reader-0123456789": ("acme", "read"),
    "bolt-writer-0123456789": ("bolt", "write"),
    "ops-admin-000123456789": ("ops", "admin"),
}
ACME_W, ACME_R, BOLT_W, ADMIN = TOKENS


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


@pytest.fixture(scope="module")
def secured() -> Iterator[NodeProcess]:
    node = start_node("--dram-capacity", "64MiB", "--auth-tokens", tokens_file(TOKENS))
    yield node
    node.stop()


def test_open_mode_warns_loudly() -> None:
    node = start_node("--dram-capacity", "8MiB", "--no-ssd")
    try:
        time.sleep(0.2)
        assert any("OPEN MODE" in line for line in node.output), "".join(node.output)
        with Client(node.url) as c:
            assert c.server_info["tenant"] is None and c.server_info["role"] == "admin"
    finally:
        node.stop()


def test_every_connection_must_authenticate(secured: NodeProcess) -> None:
    assert any("auth on, 4 tokens" in line for line in secured.output)
    for token in ("", "not-a-token-of-this-node"):
        with pytest.raises(AuthenticationError), Client(secured.url, token=token) as c:
            c.exists_many([key(1)])
    with Client(secured.url, token=ACME_W) as c:
        assert c.server_info["tenant"] == "acme" and c.server_info["role"] == "write"
        c.put(key(1), b"x" * 100)
    status, stats = http_json(f"{secured.admin_url}/v1/stats", token=ADMIN)
    assert status == 200
    assert stats["auth"]["mode"] == "tokens" and stats["auth"]["failures"] >= 2
    assert stats["errors"].get("unauthenticated", 0) >= 2


def test_token_from_environment(secured: NodeProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_TOKEN", BOLT_W)
    with Client(secured.url) as c:
        assert c.server_info["tenant"] == "bolt"


def test_roles(secured: NodeProcess) -> None:
    k = key(2)
    with Client(secured.url, token=ACME_R) as reader:
        for call in (lambda: reader.put(k, b"v"), lambda: reader.delete(k),
                     lambda: reader.pin(k)):
            with pytest.raises(PermissionDeniedError):
                call()
        assert reader.exists_many([k]) == [False]  # the connection survives a refusal
    with Client(secured.url, token=ACME_W) as writer:
        writer.put(k, b"acme-value")
    with Client(secured.url, token=ACME_R) as reader:
        assert reader.get(k) == b"acme-value"  # a reader of the same tenant sees it
    with Client(secured.url, token=ACME_W, scope="raw") as raw, \
            pytest.raises(PermissionDeniedError, match="admin"):
        raw.get(k)
    with Client(secured.url, token=ACME_W, scope="shared") as shared, \
            pytest.raises(PermissionDeniedError, match="shared"):
        shared.put(key(3), b"public")


def test_tenants_cannot_see_each_others_chunks(secured: NodeProcess) -> None:
    k, other = key(10), key(11)
    with Client(secured.url, token=ACME_W) as acme:
        acme.put_many([k, other], [b"acme-secret", b"acme-2"])
        assert acme.lookup([k, other]) == 2
    with Client(secured.url, token=BOLT_W) as bolt:
        assert bolt.get(k) is None
        assert bolt.exists_many([k, other]) == [False, False]
        assert bolt.lookup([k, other]) == 0
        assert bolt.pin(k) is False
        assert bolt.delete(k) is False
        bolt.put(k, b"bolt-own")  # the same key in its own scope is its own chunk
        assert bolt.get(k) == b"bolt-own"
    with Client(secured.url, token=ACME_W) as acme:
        assert acme.get(k) == b"acme-secret"  # untouched by bolt's delete and put
    # an admin reading raw keys finds acme's chunk only under its scoped key
    with Client(secured.url, token=ADMIN, scope="raw") as raw:
        assert raw.get(scope_key("acme", k)) == b"acme-secret"
        assert raw.get(scope_key("bolt", k)) == b"bolt-own"
        assert raw.get(k) is None


def test_shared_scope(secured: NodeProcess) -> None:
    k = key(20)
    with Client(secured.url, token=ADMIN, scope="shared") as admin:
        admin.put(k, b"system prompt")
    for token in (ACME_R, BOLT_W):
        with Client(secured.url, token=token, scope="shared") as c:
            assert c.get(k) == b"system prompt"
            assert c.lookup([k]) == 1
        with Client(secured.url, token=token) as c:
            assert c.get(k) is None  # the tenant scope is a different key


def test_pipelined_frames_behind_hello_are_scoped(secured: NodeProcess) -> None:
    """HELLO and a PUT in one write: the PUT is parsed before HELLO is served."""
    k = key(30)
    value = seal(b"pipelined") + b"pipelined"
    frames = [*encode_frame(Op.HELLO, 1, [encode_json({"protocol": 1, "token": BOLT_W})]),
              *encode_frame(Op.PUT, 2, [PutItemHeader(k, len(value)).pack(), value], count=1)]
    with socket.create_connection((secured.host, secured.port), timeout=5) as s:
        s.sendall(b"".join(frames))
        data = b""
        while data.count(b"KV") < 2 or len(data) < 48:
            data += s.recv(4096)
        while len(data) < 24 + FrameHeader.unpack(data[:24]).body_len + 25:
            data += s.recv(4096)
        rest = data[24 + FrameHeader.unpack(data[:24]).body_len:]
        second = FrameHeader.unpack(rest[:24])
        assert second.op == Op.PUT and second.status == 0 and rest[24] == 0  # item stored
    with Client(secured.url, token=BOLT_W) as bolt:
        assert bolt.get(k) == b"pipelined"
    with Client(secured.url, token=ADMIN, scope="raw") as raw:
        assert raw.get(k) is None


def test_only_admins_may_write_through_shared_memory(secured: NodeProcess) -> None:
    """Tenants read and PUT over TCP: the arena holds every tenant's chunks, and a writable
    mapping would let one tenant plant checksummed values in another's chunks."""
    value = os.urandom(2 << 20)
    with Client(secured.url, token=ACME_W) as acme, \
            Client(secured.url, token=ADMIN, shm=True, scope="shared") as admin:
        acme.put(key(900), value)
        admin.put(key(901), value)
        assert acme.get(key(900)) == value and admin.get(key(901)) == value
        assert acme.put_bytes_by_path == {"shm": 0, "tcp": len(value)}
        assert admin.put_bytes_by_path == {"shm": len(value), "tcp": 0}
        assert acme.bytes_by_path == {"shm": 0, "tcp": len(value)}
        assert admin.bytes_by_path == {"shm": len(value), "tcp": 0}
        tenant = acme.async_client._router.standalone_node
        operator = admin.async_client._router.standalone_node
        assert tenant is not None and tenant.path.mapping is None  # never offered the arena
        # the arena index holds stored (scoped) keys: a scoped admin reads through GET_SHM
        assert operator is not None and operator.path.mapping is not None
        assert operator.path.mapping.index is None and admin.async_client.shm_index_hits == 0


def test_admin_api_needs_tokens_and_roles(secured: NodeProcess) -> None:
    base = secured.admin_url
    assert http_json(f"{base}/healthz")[0] == 200
    assert http_json(f"{base}/v1/stats")[0] == 401
    assert http_json(f"{base}/v1/stats", token="wrong-token-000000000")[0] == 401
    assert http_json(f"{base}/v1/stats", token=ACME_R)[0] == 200
    assert http_json(f"{base}/v1/admin/flush", "POST", token=ACME_W)[0] == 403
    assert http_json(f"{base}/v1/admin/flush", "POST", token=ADMIN)[0] == 200
    k = key(40)
    with Client(secured.url, token=ACME_W) as acme:
        acme.put(k, b"acme-40")
    assert http_json(f"{base}/v1/chunks/{k.hex()}", token=ACME_R)[0] == 200
    assert http_json(f"{base}/v1/chunks/{k.hex()}", token=BOLT_W)[0] == 404
    assert http_json(f"{base}/v1/chunks/{k.hex()}", "DELETE", token=ACME_R)[0] == 403
    assert http_json(f"{base}/v1/chunks/{k.hex()}?scope=raw", token=ACME_R)[0] == 403
    status, body = http_json(f"{base}/v1/lookup", "POST", {"keys": [k.hex()]}, token=BOLT_W)
    assert status == 200 and body["num_chunks"] == 0
    status, body = http_json(f"{base}/v1/lookup", "POST", {"keys": [k.hex()]}, token=ACME_R)
    assert status == 200 and body["num_chunks"] == 1
    status, stats = http_json(f"{base}/v1/stats", token=ADMIN)
    assert status == 200
    assert stats["auth"]["tenant_bytes"]["acme"]["dram"] > 0
    assert "tenant_bytes" not in http_json(f"{base}/v1/stats", token=ACME_R)[1]["auth"]


@pytest.mark.parametrize("scope", ["tenant", "shared", "raw"])
@pytest.mark.parametrize("token", [ACME_R, ACME_W, ADMIN])
def test_admin_api_and_data_port_answer_from_one_table(secured: NodeProcess, token: str,
                                                       scope: str) -> None:
    """Every chunk route and lookup, for every role and scope, is refused exactly where the
    data port refuses the same op (a write token may not delete or pin shared chunks)."""
    k = key(50)
    with Client(secured.url, token=ADMIN, scope="shared") as admin:
        admin.put(k, b"shared-50")
    with Client(secured.url, token=ACME_W) as acme:
        acme.put(k, b"acme-50")
    base, query = secured.admin_url, f"?scope={scope}"
    routes = {
        "exists": (f"/v1/chunks/{k.hex()}{query}", "GET", None),
        "pin": (f"/v1/chunks/{k.hex()}/pin{query}", "POST", None),
        "unpin": (f"/v1/chunks/{k.hex()}/unpin{query}", "POST", None),
        "lookup": ("/v1/lookup", "POST", {"keys": [k.hex()], "scope": scope}),
        "delete": (f"/v1/chunks/{k.hex()}{query}", "DELETE", None),
    }
    with Client(secured.url, token=token, scope=scope) as c:
        calls = {"exists": lambda: c.exists_many([k]), "pin": lambda: c.pin(k),
                 "unpin": lambda: c.unpin(k), "lookup": lambda: c.lookup([k]),
                 "delete": lambda: c.delete(k)}
        for name, (path, method, body) in routes.items():
            try:
                calls[name]()
                data_port_denied = False
            except PermissionDeniedError:
                data_port_denied = True
            status, reply = http_json(base + path, method, body, token=token)
            assert (status == 403) == data_port_denied, (name, status, reply)
            assert status in (200, 403, 404), (name, status, reply)


def test_a_non_utf8_authorization_header_is_401(secured: NodeProcess) -> None:
    node = start_node("--dram-capacity", "8MiB", "--no-ssd", "--admin-token",
                      "admin-token-0123456789")
    try:
        for n in (node, secured):
            port = int(n.admin_url.rsplit(":", 1)[1])
            with socket.create_connection((n.host, port), timeout=5) as s:
                s.sendall(b"POST /v1/admin/flush HTTP/1.1\r\nHost: x\r\n"
                          b"Authorization: Bearer \xff\xfe\r\nContent-Length: 0\r\n"
                          b"Connection: close\r\n\r\n")
                head = s.recv(4096)
            assert head.startswith(b"HTTP/1.1 401"), head[:80]
    finally:
        node.stop()


def test_tenant_scope_reaches_ssd_and_s3(s3_endpoint: str, s3_bucket: str) -> None:
    import boto3

    node = start_node("--dram-capacity", "16MiB", "--auth-tokens", tokens_file(TOKENS),
                      "--s3-bucket", s3_bucket, "--s3-endpoint", s3_endpoint,
                      "--s3-write-through", env={"AWS_ACCESS_KEY_ID": "testing",
                                                 "AWS_SECRET_ACCESS_KEY": "testing"})
    try:
        k = key(50)
        with Client(node.url, token=ACME_W) as acme:
            acme.put(k, b"durable acme chunk" * 100)
        names = [o["Key"] for o in boto3.client("s3", endpoint_url=s3_endpoint,
                                                region_name="us-east-1")
                 .list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
        assert any(scope_key("acme", k).hex() in n for n in names), names
        assert not any(k.hex() in n for n in names), names
        assert http_json(f"{node.admin_url}/v1/admin/flush", "POST", token=ADMIN)[0] == 200
        status, _ = http_json(f"{node.admin_url}/v1/admin/evict", "POST", {"tier": "dram"},
                              token=ADMIN)
        assert status == 200
        with Client(node.url, token=BOLT_W) as bolt:
            assert bolt.get(k) is None  # not promoted from SSD or S3 into bolt's scope
        with Client(node.url, token=ACME_W) as acme:
            assert acme.get(k) == b"durable acme chunk" * 100  # promoted from SSD
    finally:
        node.stop()


def test_sighup_reloads_tokens_and_closes_revoked(tmp_path: Path) -> None:
    path = tokens_file({ACME_W: ("acme", "write"), ADMIN: ("ops", "admin")})
    node = start_node("--dram-capacity", "8MiB", "--no-ssd", "--auth-tokens", path)
    try:
        acme = Client(node.url, token=ACME_W, pool_size=1)
        acme.put(key(60), b"before")
        newcomer = "newcomer-token-0123456789"
        Path(path).write_text(Path(tokens_file({newcomer: ("acme", "write"),
                                                ADMIN: ("ops", "admin")})).read_text())
        node.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with Client(node.url, token=newcomer) as c:
                    assert c.get(key(60)) == b"before"  # same tenant: same chunks
                    break
            except AuthenticationError:
                time.sleep(0.1)
        else:
            pytest.fail("the new token was not accepted after SIGHUP")
        # the revoked token's open connection was closed; reconnecting fails
        errors = []
        for _ in range(2):
            try:
                acme.get(key(60))
            except (AuthenticationError, KvpoolConnectionError) as exc:
                errors.append(type(exc))
        # the open connection was closed under it (had it stayed open, the get would
        # succeed): the sync client sees that before it sends, and reconnecting is refused
        assert errors == [AuthenticationError, AuthenticationError]
        acme.close()
        Path(path).write_text("this is not toml [[[")
        node.proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        with Client(node.url, token=newcomer) as c:
            assert c.get(key(60)) == b"before"  # a bad file keeps the previous table
        assert any("not reloaded" in line for line in node.output)
    finally:
        node.stop()


def test_dram_quota_evicts_only_the_tenants_own_chunks() -> None:
    path = tokens_file(TOKENS, '[tenant.acme]\ndram_quota = "1MiB"\n')
    node = start_node("--dram-capacity", "16MiB", "--no-ssd", "--auth-tokens", path)
    try:
        value = b"q" * (200 << 10)
        with Client(node.url, token=BOLT_W) as bolt:
            bolt.put_many([key(100 + i) for i in range(10)], [value] * 10)
        with Client(node.url, token=ACME_W) as acme:
            for i in range(20):  # 4 MiB through a 1 MiB quota
                acme.put(key(200 + i), value)
            assert acme.get(key(219)) == value
            assert acme.get(key(200)) is None  # its own oldest chunks made room
        status, stats = http_json(f"{node.admin_url}/v1/stats", token=ADMIN)
        assert status == 200
        assert stats["auth"]["tenant_bytes"]["acme"]["dram"] <= 1 << 20
        assert stats["auth"]["quota_evictions"] >= 15
        with Client(node.url, token=BOLT_W) as bolt:
            assert all(v == value for v in bolt.get_many([key(100 + i) for i in range(10)]))
    finally:
        node.stop()


def test_ssd_quota_drops_the_tenants_oldest_ssd_chunks() -> None:
    path = tokens_file(TOKENS, '[tenant.acme]\nssd_quota = "1MiB"\n')
    node = start_node("--dram-capacity", "32MiB", "--auth-tokens", path)
    try:
        value = b"s" * (200 << 10)
        with Client(node.url, token=BOLT_W) as bolt:
            bolt.put_many([key(300 + i) for i in range(10)], [value] * 10)
        with Client(node.url, token=ACME_W) as acme:
            for i in range(20):  # 4 MiB of write-behind through a 1 MiB SSD quota
                acme.put(key(400 + i), value)
        assert http_json(f"{node.admin_url}/v1/admin/flush", "POST", token=ADMIN)[0] == 200
        status, stats = http_json(f"{node.admin_url}/v1/stats", token=ADMIN)
        assert status == 200
        usage = stats["auth"]["tenant_bytes"]["acme"]
        assert 0 < usage["ssd"] <= 1 << 20
        assert usage["dram"] >= 20 * len(value)  # DRAM has no quota here: all still cached
        # at most 5 of acme's 20 chunks fit in 1 MiB: each other one was either written
        # and then dropped for a newer one, or shed before it was queued (when the
        # writes still queued already fill the quota); bolt has no quota and sheds none
        ssd = stats["tiers"]["ssd"]
        assert stats["auth"]["ssd_quota_evictions"] + ssd["shed"] >= 15
        # bolt's write-behind was untouched: its 10 chunks are on SSD
        with Client(node.url, token=ADMIN, scope="raw") as raw:
            tiers = raw.exists_tiers([scope_key("bolt", key(300 + i)) for i in range(10)])
            assert tiers == ["dram"] * 10
        assert ssd["num_objects"] >= 10 + 1
    finally:
        node.stop()


def test_tokens_file_errors_are_clear(tmp_path: Path) -> None:
    from kvpool.protocol.errors import ConfigError

    cases = {
        'token = "x"': "no [[token]]",
        '[[token]]\ntoken = "short"\ntenant = "a"': "at least 16",
        '[[token]]\ntoken = "0123456789abcdef"\ntenant = "a b"': "tenant must be",
        '[[token]]\ntoken = "0123456789abcdef"\ntenant = "a"\nrole = "root"': "role must be",
        '[[token]]\nsha256 = "abc"\ntenant = "a"': "64 hex",
    }
    for text, message in cases.items():
        path = tmp_path / "t.toml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_tokens(path)
    import hashlib

    digest = hashlib.sha256(b"hashed-token-0123456789").hexdigest()
    path.write_text(f'[[token]]\nsha256 = "{digest}"\ntenant = "acme"\nrole = "read"\n')
    table = load_tokens(path)
    principal = table.authenticate("hashed-token-0123456789")
    assert principal is not None and principal.tenant == "acme"
    assert table.authenticate("hashed-token-012345678") is None
