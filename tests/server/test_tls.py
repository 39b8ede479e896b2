"""TLS on the data and admin ports, with a CA the test makes (trustme), and client certs."""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from kvpool.client import AsyncClient, Client, KvpoolConnectionError
from tests.conftest import NodeProcess, start_node


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def pki(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("pki")
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("engine-1@example.test")
    paths = {"ca": d / "ca.pem", "cert": d / "node.pem", "key": d / "node.key",
             "client_cert": d / "client.pem", "client_key": d / "client.key"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    server.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    for pem in server.cert_chain_pems[1:]:
        pem.write_to_path(str(paths["cert"]), append=True)
    server.private_key_pem.write_to_path(str(paths["key"]))
    client.cert_chain_pems[0].write_to_path(str(paths["client_cert"]))
    client.private_key_pem.write_to_path(str(paths["client_key"]))
    return {k: str(v) for k, v in paths.items()}


@pytest.fixture(scope="module")
def tls_node(pki: dict[str, str]) -> Iterator[NodeProcess]:
    node = start_node("--dram-capacity", "16MiB", "--no-ssd", "--tls-cert", pki["cert"],
                      "--tls-key", pki["key"])
    yield node
    node.stop()


def test_data_port_speaks_tls(tls_node: NodeProcess, pki: dict[str, str]) -> None:
    ctx = ssl.create_default_context(cafile=pki["ca"])
    with Client(tls_node.url, ssl=ctx) as c:
        c.put(b"k" * 16, b"over tls" * 1000)
        assert c.get(b"k" * 16) == b"over tls" * 1000
        big = bytes(range(256)) * 16384  # 4 MiB: many TLS records, its checksum after it
        c.put(b"b" * 16, big)
        assert c.get(b"b" * 16) == big

    async def on_the_loop() -> list[bytearray | None]:
        async with AsyncClient(tls_node.url, ssl=ctx) as ac:
            await ac.put_many([b"c" * 16, b"d" * 16], [big[: 1 << 20], big[1 << 20 :]])
            return await ac.get_many([b"c" * 16, b"d" * 16])

    assert asyncio.run(on_the_loop()) == [big[: 1 << 20], big[1 << 20 :]]


def test_plain_and_untrusted_clients_are_refused(tls_node: NodeProcess) -> None:
    with pytest.raises(KvpoolConnectionError), Client(tls_node.url, timeout=3) as c:
        c.get(b"k" * 16)
    other = trustme.CA()
    ctx = ssl.create_default_context()
    other.configure_trust(ctx)
    with pytest.raises(KvpoolConnectionError, match="CERTIFICATE_VERIFY_FAILED"), \
            Client(tls_node.url, ssl=ctx) as c:
        c.get(b"k" * 16)


def test_admin_port_speaks_tls(tls_node: NodeProcess, pki: dict[str, str]) -> None:
    assert tls_node.admin_url.startswith("https://")
    ctx = ssl.create_default_context(cafile=pki["ca"])
    with urllib.request.urlopen(f"{tls_node.admin_url}/healthz", context=ctx, timeout=10) as r:
        assert json.load(r)["status"] == "ok"
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(tls_node.admin_url.replace("https", "http") + "/healthz",
                               timeout=10)


def test_cli_reaches_a_tls_node_with_its_ca(tls_node: NodeProcess, pki: dict[str, str]) -> None:
    """kvpool stats / cluster status verify an https admin URL against --cacert (or
    $KVPOOL_TLS_CA); without it the system's CAs refuse the test CA's certificate."""
    import subprocess
    import sys

    def kvpool(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvpool.cli", *args], text=True,
                              capture_output=True, timeout=60, check=False,
                              env={**os.environ, **(env or {})})

    done = kvpool("stats", "--admin", tls_node.admin_url, "--cacert", pki["ca"], "--json")
    assert done.returncode == 0, done.stderr
    assert "requests" in json.loads(done.stdout)
    done = kvpool("cluster", "status", "--admin", tls_node.admin_url, "--json",
                  env={"KVPOOL_TLS_CA": pki["ca"]})
    assert done.returncode == 0, done.stderr
    refused = kvpool("stats", "--admin", tls_node.admin_url,
                     env={"KVPOOL_TLS_CA": ""})
    assert refused.returncode == 2 and "CERTIFICATE_VERIFY_FAILED" in refused.stderr


def test_client_certificates_when_required(pki: dict[str, str]) -> None:
    node = start_node("--dram-capacity", "8MiB", "--no-ssd", "--tls-cert", pki["cert"],
                      "--tls-key", pki["key"], "--tls-client-ca", pki["ca"])
    try:
        without = ssl.create_default_context(cafile=pki["ca"])
        with pytest.raises(KvpoolConnectionError), Client(node.url, ssl=without, timeout=3) as c:
            c.get(b"k" * 16)
        with_cert = ssl.create_default_context(cafile=pki["ca"])
        with_cert.load_cert_chain(pki["client_cert"], pki["client_key"])
        with Client(node.url, ssl=with_cert) as c:
            c.put(b"m" * 16, b"mutual")
            assert c.get(b"m" * 16) == b"mutual"
    finally:
        node.stop()


def test_tls_config_errors(tmp_path: Path, pki: dict[str, str]) -> None:
    from kvpool.protocol.errors import ConfigError
    from kvpool.server.config import SecurityConfig

    with pytest.raises(ConfigError, match="both"):
        SecurityConfig(tls_cert=pki["cert"])
    with pytest.raises(ConfigError, match="no such file"):
        SecurityConfig(tls_cert=str(tmp_path / "none.pem"), tls_key=pki["key"])
    with pytest.raises(ConfigError, match="needs TLS"):
        SecurityConfig(tls_client_ca=pki["ca"])


def test_cluster_over_tls_with_tokens(pki: dict[str, str], tmp_path: Path) -> None:
    """Nodes reach each other (admin lookups) over TLS with the peer token, in raw scope."""
    from kvpool.cli.local_cluster import LocalCluster
    from tests.server.test_security import ADMIN, TOKENS, key, tokens_file

    acme = next(t for t, (tenant, role) in TOKENS.items() if tenant == "acme" and role == "write")
    serve = ["--no-ssd", "--dram-capacity", "16MiB", "--tls-cert", pki["cert"], "--tls-key",
             pki["key"], "--tls-ca", pki["ca"], "--auth-tokens", tokens_file(TOKENS),
             "--peer-token", ADMIN]
    ctx = ssl.create_default_context(cafile=pki["ca"])
    with LocalCluster(3, replication=1, data_dir=tmp_path / "c", serve_args=serve) as cluster:
        keys = [key(700 + i) for i in range(64)]
        with Client(cluster.seeds, token=acme, ssl=ctx) as c:
            c.put_many(keys, [b"tls-cluster"] * len(keys))
            assert c.lookup(keys) == len(keys)
        # any node answers for the whole cluster: it asks the owners over TLS
        node = cluster.nodes[0]
        request = urllib.request.Request(
            f"https://127.0.0.1:{node.admin_port}/v1/lookup", method="POST",
            data=json.dumps({"keys": [k.hex() for k in keys]}).encode(),
            headers={"Authorization": f"Bearer {acme}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, context=ctx, timeout=30) as r:
            assert json.load(r)["num_chunks"] == len(keys)
        # the CLI: a read token and the CA, for the node asked and each node of its map
        import subprocess
        import sys

        status = [sys.executable, "-m", "kvpool.cli", "cluster", "status", "--json",
                  "--admin", f"https://127.0.0.1:{node.admin_port}", "--cacert", pki["ca"]]
        done = subprocess.run([*status, "--token", acme], capture_output=True, text=True,
                              timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert all(json.loads(done.stdout)["stats"].values())  # all 3 nodes answered
        refused = subprocess.run(status, capture_output=True, text=True, timeout=60,
                                 check=False, env={**os.environ, "KVPOOL_ADMIN_TOKEN": ""})
        assert refused.returncode == 2 and "401" in refused.stderr


def test_tls_clients_that_never_read_cannot_grow_node_memory(
        tls_node: NodeProcess, pki: dict[str, str]) -> None:
    """12 TLS clients each ask for one 4 MiB value 64 times and 12 times more, and never
    read: the node copies replies into TLS only as the peer drains them, so its RSS stays
    bounded (it once grew by >1 GiB) and comes back once they are gone."""
    import socket
    import struct
    import time

    import psutil

    frame = struct.Struct("<2sBBIIIQ")
    k = b"t" * 16
    value = os.urandom(4 << 20)
    ctx = ssl.create_default_context(cafile=pki["ca"])
    with Client(tls_node.url, ssl=ctx) as c:
        c.put(k, value)
        assert c.get(k) == value
    node = psutil.Process(tls_node.proc.pid)
    baseline = node.memory_info().rss
    hello = json.dumps({"protocol": 1}).encode()
    get_64 = frame.pack(b"KV", 3, 0, 2, 64, 0, 16 * 64) + k * 64
    get_12 = frame.pack(b"KV", 3, 0, 3, 12, 0, 16 * 12) + k * 12
    hogs = []
    try:
        for _ in range(12):
            raw = socket.create_connection((tls_node.host, tls_node.port), timeout=10)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            s = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
            s.sendall(frame.pack(b"KV", 1, 0, 1, 0, 0, len(hello)) + hello + get_64 + get_12)
            hogs.append(s)
        time.sleep(2.0)
        grown = node.memory_info().rss - baseline
    finally:
        for s in hogs:
            s.close()
    # 12 connections x (256 KiB pieces + 256 KiB TLS buffer + socket buffers): tens of MiB;
    # values copied whole would be 12 x 76 x 4 MiB
    assert grown < 96 << 20, f"node RSS grew by {grown >> 20} MiB"
    with Client(tls_node.url, ssl=ctx) as c:  # the node serves on; the value is intact
        assert c.get(k) == value
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and node.memory_info().rss - baseline > 32 << 20:
        time.sleep(0.2)
    assert node.memory_info().rss - baseline < 32 << 20
