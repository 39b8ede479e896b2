"""LMCache (PyPI's lmcache 0.5.6) keeping its remote tier in kvpool, through real nodes.

LMCache lives in the engines' environment (``$VLLM_CPU_PYTHON``, made by ``.ci/run``),
driven by ``tests/lmcache_driver.py`` (see its doc: LMCache's own config, allocator and
plugin launcher); the nodes and the checks run here.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.cli.local_cluster import LocalCluster
from kvpool.client import Client
from kvpool.protocol.frames import Op
from tests.client.test_hostile_nodes import HalfLies, claims_1000, one_more_item, only
from tests.conftest import ROOT, NodeProcess, put_corrupt, start_node
from tests.hostile_node import LyingNode, hello_with

PYTHON = os.environ.get("VLLM_CPU_PYTHON", "")
if not PYTHON or not Path(PYTHON).exists():
    if os.environ.get("CI"):
        pytest.fail("CI must set VLLM_CPU_PYTHON (.ci/run makes the engines' environment)",
                    pytrace=False)
    pytest.skip("set VLLM_CPU_PYTHON to a python with lmcache==0.5.6 and kvpool "
                "(see .ci/run)", allow_module_level=True)


pytestmark = pytest.mark.slow  # LMCache in the engines' environment


def _run(tmp: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """``tests/lmcache_driver.py`` on ``spec`` in LMCache's environment: its JSON answer
    plus its ``log``."""
    path, out = tmp / f"spec-{time.monotonic_ns()}.json", tmp / f"out-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(spec))
    done = subprocess.run([PYTHON, "-m", "tests.lmcache_driver", str(path), str(out)],
                          capture_output=True, text=True, timeout=180, check=False, cwd=ROOT)
    assert done.returncode == 0 and out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    result["log"] = done.stdout + done.stderr
    return result


def driver(tmp: Path, url: str, steps: list[dict[str, Any]],
           extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return _run(tmp, {"url": url, "extra": extra or {}, "steps": steps})


@pytest.fixture
def pool() -> Iterator[NodeProcess]:
    node = start_node("--dram-capacity", "256MiB", "--no-ssd")
    yield node
    node.stop()


def test_chunks_one_lmcache_stores_load_into_another(pool: NodeProcess,
                                                     tmp_path: Path) -> None:
    """Process A puts three full chunks and a partial one (LMCache's allocator, LMCache's
    launcher); process B finds the leading three in one lookup and gets each back bit for
    bit, the partial one with its own token count; a chunk never stored is a miss."""
    stored = driver(tmp_path, pool.url, [
        {"do": "contains", "hashes": [1, 2, 3]},
        {"do": "put", "chunks": [[1, 16, 11], [2, 16, 12], [3, 16, 13], [4, 5, 14]]},
        {"do": "contains", "hashes": [1, 2, 3, 9, 4]},
    ])
    assert stored["made"], stored.get("error")
    assert stored["connector"] == "KvpoolRemoteConnector"
    assert stored["steps"][0] == 0 and stored["steps"][2] == 3
    assert stored["counters"]["puts"] == 4 and stored["counters"]["errors"] == 0

    loaded = driver(tmp_path, pool.url, [
        {"do": "exists", "hash": 4},
        {"do": "get", "hashes": [1, 2, 3, 4, 9], "seeds": [11, 12, 13, 14, 0]},
    ])
    exists, got = loaded["steps"]
    assert exists is True
    assert got == [{"tokens": 16, "equal": True}] * 3 + [{"tokens": 5, "equal": True}, None]
    assert loaded["counters"]["hits"] == 4 and loaded["counters"]["misses"] == 1


def test_a_corrupt_chunk_is_a_miss_and_the_others_load(pool: NodeProcess,
                                                       tmp_path: Path) -> None:
    run = driver(tmp_path, pool.url, [
        {"do": "put", "chunks": [[1, 16, 21], [2, 16, 22]]},
        {"do": "key", "hash": 2},
    ])
    key = bytes.fromhex(run["steps"][1])
    with Client(pool.url, shm=False) as c:
        original = bytes(c.get(key) or b"")
    assert original
    put_corrupt(pool, key, original, flip=200)
    loaded = driver(tmp_path, pool.url, [
        {"do": "get", "hashes": [1, 2], "seeds": [21, 22]},
    ])
    assert loaded["steps"][0] == [{"tokens": 16, "equal": True}, None]
    assert loaded["counters"]["errors"] == 0  # a bad chunk is a miss, not a pool failure


def test_a_dead_address_costs_misses_never_an_exception(tmp_path: Path) -> None:
    node = start_node("--dram-capacity", "64MiB", "--no-ssd")
    url = node.url
    node.stop()
    run = driver(tmp_path, url, [
        {"do": "contains", "hashes": [1, 2]},
        {"do": "exists", "hash": 1},
        {"do": "get", "hashes": [1], "seeds": [0]},
        {"do": "put", "chunks": [[1, 16, 1]]},
    ], extra={"remote_storage_plugin.kvpool.timeout_s": 1.0})
    assert run["made"]
    assert run["steps"] == [0, False, [None], None]
    assert run["counters"]["errors"] == 4 and run["counters"]["puts"] == 0


def test_bad_settings_fail_with_one_clear_line(tmp_path: Path) -> None:
    run = driver(tmp_path, "", [], extra={"remote_storage_plugin.kvpool.timeout": 3})
    assert not run["made"]
    assert "unknown key(s) ['remote_storage_plugin.kvpool.timeout']" in run["error"]
    run = driver(tmp_path, "", [])
    assert not run["made"] and "set remote_storage_plugin.kvpool.url" in run["error"]


def storage(tmp: Path, config: str, *, round_trip: bool = False) -> dict[str, Any]:
    """LMCache's storage built as vLLM's LMCache connector builds it, from a config file
    (``LMCACHE_CONFIG_FILE``, LMCache's own loader): see ``tests/lmcache_driver.py``."""
    path = tmp / f"lmcache-{time.monotonic_ns()}.yaml"
    path.write_text(config)
    return _run(tmp, {"mode": "storage", "config_file": str(path), "round_trip": round_trip})


_BASE = "chunk_size: 16\nlocal_cpu: true\nmax_local_cpu_size: 0.05\n"
_PLUGIN = ("remote_storage_plugins: [\"kvpool\"]\nextra_config:\n"
           "  remote_storage_plugin.kvpool.module_path: kvpool.gpu.lmcache\n"
           "  remote_storage_plugin.kvpool.class_name: KvpoolConnectorAdapter\n")


def test_the_documented_config_file_gives_lmcache_a_kvpool_backend(pool: NodeProcess,
                                                                   tmp_path: Path) -> None:
    """The README's LMCache config, as a file LMCache loads itself: one remote backend,
    on kvpool, connected; a chunk put through it comes back bit for bit."""
    run = storage(tmp_path, _BASE + _PLUGIN + f"  remote_storage_plugin.kvpool.url: {pool.url}\n",
                  round_trip=True)
    assert run["started"] and run["backends"] == ["LocalCPUBackend", "RemoteBackend-kvpool"]
    assert run["connected"] == [True] and run["round_trip"] is True


def test_config_mistakes_never_leave_an_idle_kvpool_backend(pool: NodeProcess,
                                                           tmp_path: Path) -> None:
    """A typo in the plugin's keys: no kvpool backend, and LMCache's ERROR line names the
    key (before: a backend that never connected, behind one WARNING). remote_url kvpool://
    beside the plugin: LMCache does not start, and the line says to drop remote_url
    (before: two remote backends on one pool). remote_url alone: LMCache never loads
    kvpool (it loads only the adapters remote_storage_plugins names): its backend stays
    idle with LMCache's own warning, as docs/gpu.md says."""
    typo = storage(tmp_path, _BASE + _PLUGIN + f"  remote_storage_plugin.kvpool.urll: {pool.url}\n")
    assert typo["started"] and typo["backends"] == ["LocalCPUBackend"]
    assert any(line.startswith("ERROR") and "remote_storage_plugin.kvpool.urll" in line
               for line in typo["lines"]), typo["lines"]

    both = storage(tmp_path, _BASE + f"remote_url: {pool.url}\n" + _PLUGIN
                   + f"  remote_storage_plugin.kvpool.url: {pool.url}\n")
    assert not both["started"] and "drop remote_url" in both["error"], both

    alone = storage(tmp_path, _BASE + f"remote_url: {pool.url}\n")
    assert alone["connected"] == [False]
    assert any("No adapter found for URL" in line for line in alone["lines"]), alone["lines"]


def test_a_three_node_cluster_serves_every_chunk_with_a_node_killed(tmp_path: Path) -> None:
    with LocalCluster(3, replication=2, data_dir=tmp_path / "c3",
                      serve_args=["--no-ssd", "--dram-capacity", "128MiB"]) as cluster:
        seeds = "kvpool://" + ",".join(cluster.seeds)
        victim = cluster.nodes[2].proc
        assert victim is not None
        chunks = [[h, 16, 100 + h] for h in range(1, 9)]
        # the connector's client is connected to every node when the node dies (it just
        # stored through them): its next calls meet a dead connection
        run = driver(tmp_path, seeds, [
            {"do": "put", "chunks": chunks},
            {"do": "kill", "pid": victim.pid},
            {"do": "contains", "hashes": list(range(1, 9))},
            {"do": "get", "hashes": list(range(1, 9)), "seeds": [100 + h for h in range(1, 9)]},
        ])
    _, _, found, got = run["steps"]
    assert found == 8
    assert got == [{"tokens": 16, "equal": True}] * 8


def test_a_tls_node_with_tokens_through_the_plugins_settings(tmp_path: Path) -> None:
    """tls_ca and token reach the client: chunks round-trip through a node that serves TLS
    and requires a token; without the token every call is a miss."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {name: tmp_path / name for name in ("ca.pem", "node.pem", "node.key")}
    ca.cert_pem.write_to_path(str(paths["ca.pem"]))
    for i, pem in enumerate(cert.cert_chain_pems):
        pem.write_to_path(str(paths["node.pem"]), append=i > 0)
    cert.private_key_pem.write_to_path(str(paths["node.key"]))
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[[token]]\ntoken = "engine-secret-0123456789"\ntenant = "acme"\n'
                      'role = "write"\n')
    node = start_node("--dram-capacity", "64MiB", "--no-ssd", "--tls-cert",
                      str(paths["node.pem"]), "--tls-key", str(paths["node.key"]),
                      "--auth-tokens", str(tokens))
    try:
        settings = {"remote_storage_plugin.kvpool.tls_ca": str(paths["ca.pem"]),
                    "remote_storage_plugin.kvpool.token": "engine-secret-0123456789"}
        run = driver(tmp_path, node.url, [
            {"do": "put", "chunks": [[1, 16, 31], [2, 16, 32]]},
            {"do": "get", "hashes": [1, 2], "seeds": [31, 32]},
        ], extra=settings)
        assert run["steps"][1] == [{"tokens": 16, "equal": True}] * 2
        assert run["counters"]["errors"] == 0
        no_token = driver(tmp_path, node.url, [
            {"do": "get", "hashes": [1], "seeds": [31]},
        ], extra={"remote_storage_plugin.kvpool.tls_ca": str(paths["ca.pem"])})
        assert no_token["steps"][0] == [None] and no_token["counters"]["errors"] == 1
    finally:
        node.stop()


def test_a_chunk_of_another_shape_with_the_same_bytes_is_a_miss(pool: NodeProcess,
                                                                tmp_path: Path) -> None:
    """A chunk whose header names [2, 8, 8, 16] (another layer count, the same byte length
    as this model's [2, 4, 16, 16]) is not this model's chunk: a miss, as the docs say."""
    run = driver(tmp_path, pool.url, [
        {"do": "put_shaped", "hash": 7, "shape": [2, 8, 8, 16], "seed": 3},
        {"do": "put", "chunks": [[8, 16, 4]]},
        {"do": "get", "hashes": [7, 8], "seeds": [3, 4]},
    ])
    assert run["steps"][2] == [None, {"tokens": 16, "equal": True}]
    assert run["counters"]["misses"] == 1 and run["counters"]["hits"] == 1


@pytest.mark.parametrize("lie", ["hello", "lookup", "get"])
def test_a_lying_node_costs_misses_never_an_exception(tmp_path: Path, lie: str) -> None:
    """A node whose HELLO names no max_batch, whose LOOKUP claims 1000 of 4 chunks, or
    whose GET reply has an item too many: LMCache gets misses (and at most what it
    asked), never an exception."""
    liar = LyingNode()
    try:
        driver(tmp_path, liar.url, [{"do": "put", "chunks": [[1, 16, 1], [2, 16, 2]]}])
        liar.tamper = {"hello": only(Op.HELLO, lambda _op, r: hello_with(r, max_batch=...)),
                       "lookup": only(Op.LOOKUP, claims_1000),
                       "get": only(Op.GET, one_more_item)}[lie]
        run = driver(tmp_path, liar.url, [
            {"do": "contains", "hashes": [1, 2, 3, 4]},
            {"do": "get", "hashes": [1, 2], "seeds": [1, 2]},
        ], extra={"remote_storage_plugin.kvpool.timeout_s": 2.0})
    finally:
        liar.close()
    assert run["made"]
    found, got = run["steps"]
    assert 0 <= found <= 2
    if lie == "lookup":
        assert found == 0
    if lie != "lookup":
        assert got == [None, None]
    assert run["counters"]["errors"] >= 1


def test_fuzzed_replies_cost_misses_never_an_exception(tmp_path: Path) -> None:
    """After two chunks are stored, the node rewrites half its replies at random (up to 40
    seeded lies: a byte, a cut, an extension, the header's count, length, status or op)
    while LMCache asks 20 times for four chunks and gets two: every answer is within what
    was asked, every chunk back is bit-exact or a miss, and nothing raises."""
    liar = LyingNode(close_after_lie=True)
    tamper = HalfLies(47)  # lies at seed 47, the coin at 48

    try:
        driver(tmp_path, liar.url, [{"do": "put", "chunks": [[1, 16, 1], [2, 16, 2]]}])
        liar.tamper = tamper
        run = driver(tmp_path, liar.url, [
            {"do": "contains", "hashes": [1, 2, 3, 4]},
            {"do": "get", "hashes": [1, 2], "seeds": [1, 2]},
        ] * 20, extra={"remote_storage_plugin.kvpool.timeout_s": 2.0})
    finally:
        liar.close()
    assert run["made"] and tamper.told > 0
    found, got = run["steps"][0::2], run["steps"][1::2]
    assert all(0 <= f <= 2 for f in found), found
    assert all(g is None or g == {"tokens": 16, "equal": True} for pair in got for g in pair)
    assert any(f == 2 for f in found), (found, tamper.told)  # the truth was told too
    assert run["counters"]["errors"] >= 1
