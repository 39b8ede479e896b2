"""The admin REST API on real nodes: per-chunk routes, eviction, flush, the admin token, and
the OpenAPI document (checked by schemathesis against a live node)."""

from __future__ import annotations

import os
import shutil
import subprocess
from types import SimpleNamespace
from typing import Any

import pytest

from kvpool.client import Client
from kvpool.placement.keys import Namespace
from kvpool.server.admin.api import make_admin_app
from kvpool.server.admin.openapi import openapi_document
from tests.conftest import NodeProcess, start_node
from tests.conftest import http_json as call


def test_every_route_is_in_the_openapi_document() -> None:
    stub = SimpleNamespace(node_id="n", events=None, lookup=None, change=None, admin_token="")
    app = make_admin_app(stub)  # type: ignore[arg-type]  # the route table only; never called
    routes = set()
    for resource in app.router.resources():
        path = resource.canonical
        for route in resource:
            if route.method != "HEAD":
                routes.add((route.method.lower(), path))
    documented = {(method, path) for path, ops in openapi_document()["paths"].items()
                  for method in ops}
    assert routes == documented


def test_chunk_routes_evict_and_flush() -> None:
    node = start_node("--dram-capacity", "64MiB")
    ns = Namespace(model="m", dtype="float16", num_layers=2, num_kv_heads=1, head_dim=8,
                   chunk_tokens=16)
    try:
        keys = [os.urandom(16) for _ in range(4)]
        with Client(node.url) as c:
            c.put_many(keys[:2], [b"a" * 100, b"b" * 100], num_tokens=16,
                       fingerprint=ns.digest, chunk_indexes=[0, 1], parents=[None, keys[0]])
            c.put(keys[2], b"c" * 100, ttl=60)
        base = node.admin_url
        status, info = call(f"{base}/v1/chunks/{keys[1].hex()}")
        assert status == 200
        assert info["tiers"][0] == "dram" and info["size_bytes"] == 164
        assert info["depth"] == 1 and info["num_tokens"] == 16 and info["parent"] == keys[0].hex()
        assert info["ttl_s"] is None and info["pinned"] is False and info["last_access"] > 0
        assert 55 < call(f"{base}/v1/chunks/{keys[2].hex()}")[1]["ttl_s"] <= 60
        assert call(f"{base}/v1/chunks/{keys[3].hex()}")[0] == 404
        assert call(f"{base}/v1/chunks/nothex")[0] == 400

        assert call(f"{base}/v1/chunks/{keys[0].hex()}/pin", "POST") == \
            (200, {"key": keys[0].hex(), "pinned": True})
        assert call(f"{base}/v1/chunks/{keys[0].hex()}")[1]["pinned"] is True
        assert call(f"{base}/v1/chunks/{keys[3].hex()}/pin", "POST")[0] == 404
        status, reply = call(f"{base}/v1/chunks/{keys[0].hex()}/frobnicate", "POST")
        assert status == 404 and reply["error"]["type"] == "not_found"
        status, reply = call(f"{base}/no/such/route")
        assert status == 404 and reply["error"]["type"] == "not_found"  # JSON, too

        # namespace eviction drops that namespace's unpinned DRAM chunks: keys[1] only
        status, reply = call(f"{base}/v1/admin/evict", "POST", {"namespace": ns.digest.hex()})
        assert (status, reply) == (200, {"evicted": {"dram": 1, "ssd": 0}})
        assert call(f"{base}/v1/chunks/{keys[1].hex()}")[1]["tiers"] == ["ssd"]  # written behind
        assert call(f"{base}/v1/admin/evict", "POST", {"tier": "nvme"})[0] == 400
        assert call(f"{base}/v1/admin/evict", "POST", {})[0] == 400
        assert call(f"{base}/v1/admin/flush?timeout=10", "POST") == \
            (200, {"flushed": True, "pending_writes": 0})
        status, reply = call(f"{base}/v1/admin/evict", "POST", {"tier": "dram"})
        assert reply["evicted"]["dram"] == 1  # keys[2]; keys[0] is pinned

        assert call(f"{base}/v1/chunks/{keys[0].hex()}", "DELETE") == \
            (200, {"key": keys[0].hex(), "deleted": True})
        assert call(f"{base}/v1/chunks/{keys[0].hex()}")[0] == 404
        assert call(f"{base}/v1/chunks/{keys[0].hex()}", "DELETE")[0] == 404
        assert call(f"{base}/readyz") == (200, {"ready": True, "reason": "ok",
                                               "node_id": call(f"{base}/healthz")[1]["node_id"]})
    finally:
        node.stop()


def test_mutating_routes_need_the_admin_token() -> None:
    node = start_node("--no-ssd", "--dram-capacity", "16MiB", "--admin-token", "s3cret")
    try:
        key = os.urandom(16)
        with Client(node.url) as c:
            c.put(key, b"x")
        url = f"{node.admin_url}/v1/chunks/{key.hex()}"
        status, reply = call(f"{url}/pin", "POST")
        assert status == 401 and reply["error"]["type"] == "unauthorized"
        assert call(f"{url}/pin", "POST", token="wrong")[0] == 401
        assert call(f"{url}/pin", "POST", token="s3cret")[0] == 200
        assert call(url, "DELETE")[0] == 401
        assert call(f"{node.admin_url}/v1/admin/flush", "POST")[0] == 401
        assert call(url)[0] == 200  # reads stay open
        assert call(f"{node.admin_url}/v1/lookup", "POST", {"keys": [key.hex()]})[0] == 200
    finally:
        node.stop()


@pytest.fixture
def busy_node() -> Any:
    node = start_node("--dram-capacity", "64MiB")
    with Client(node.url) as c:
        c.put_many([os.urandom(16) for _ in range(20)], [os.urandom(1000) for _ in range(20)])
    yield node
    node.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_schemathesis_finds_no_server_errors_and_no_schema_violations(
        busy_node: NodeProcess) -> None:
    exe = shutil.which("schemathesis") or shutil.which("st")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have schemathesis (the test extra)")
        pytest.skip("pip install schemathesis")
    proc = subprocess.run(
        [exe, "run", f"{busy_node.admin_url}/openapi.json",
         "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
                     "response_schema_conformance",
         "--exclude-path", "/v1/events",  # an endless stream
         "--max-examples", "30", "--workers", "1", "--request-timeout", "30",
         "--seed", "1"],
        capture_output=True, text=True, timeout=280, check=False,
        env={**os.environ, "SCHEMATHESIS_HOOKS": ""})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "passed" in out.lower()

