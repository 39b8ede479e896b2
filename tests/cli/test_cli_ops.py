"""``kvpool status``, ``lookup``, ``pin``/``unpin``, ``drain`` and ``bench`` as a user runs them,
against real node processes (a 2-node static cluster, and a node with an admin token)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.cli.local_cluster import LocalCluster
from kvpool.client import Client
from kvpool.placement.keys import ChunkHasher, Namespace
from tests.conftest import ROOT, http_json, start_node

NS = {"model": "cli-ops", "dtype": "bfloat16", "num_layers": 2, "num_kv_heads": 4,
      "head_dim": 64, "chunk_tokens": 16}


def kvpool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvpool.cli", *args], capture_output=True,
                          text=True, timeout=120, check=False, input=stdin)


@pytest.fixture(scope="module")
def cluster2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(2, replication=1, data_dir=tmp_path_factory.mktemp("c2"),
                      serve_args=["--dram-capacity", "64MiB", "--no-ssd"]) as c:
        yield c


def test_status_table_json_and_unreachable(cluster2: LocalCluster) -> None:
    admin = cluster2.nodes[1].admin_url
    out = kvpool("status", "--admin", admin, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert sorted(doc["stats"]) == sorted(n.node_id for n in cluster2.nodes)
    assert all(s["tiers"]["dram"]["capacity_bytes"] == 64 << 20 for s in doc["stats"].values())
    table = kvpool("status", "--admin", admin)
    assert table.returncode == 0
    for node in cluster2.nodes:
        assert node.node_id in table.stdout
    assert "64.0 MiB" in table.stdout and "hit rate" in table.stdout
    # 80 columns (a pipe: rich's default width): nothing is cut, addresses included
    assert "…" not in table.stdout
    assert all(len(line) <= 80 for line in table.stdout.splitlines())
    for info in doc["cluster"]["nodes"]:
        assert info["data"] in table.stdout
    # `cluster status` is the same command
    assert kvpool("cluster", "status", "--admin", admin, "--json").returncode == 0
    gone = kvpool("status", "--admin", "http://127.0.0.1:1", "--timeout", "2")
    assert gone.returncode == 2 and "cannot reach" in gone.stderr


def test_lookup_from_a_tokens_file(cluster2: LocalCluster, tmp_path: Path) -> None:
    tokens = [5] * 16 * 10 + [6] * 3  # 10 full chunks and a partial one
    keys = ChunkHasher(Namespace(**NS)).keys(tokens)  # type: ignore[arg-type]
    with Client(cluster2.seeds) as c:
        c.put_many(keys[:7], [bytes(64)] * 7)
    (tmp_path / "tokens.json").write_text(json.dumps(tokens))
    (tmp_path / "ns.json").write_text(json.dumps(NS))
    admin = cluster2.nodes[0].admin_url
    out = kvpool("lookup", "--tokens-file", str(tmp_path / "tokens.json"),
                 "--namespace", "@" + str(tmp_path / "ns.json"), "--admin", admin)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("112 of 163 tokens cached (7 of 10 full chunks of 16: 7 in dram")
    # whitespace-separated ids on stdin, JSON out
    out = kvpool("lookup", "--tokens-file", "-", "--namespace", json.dumps(NS), "--admin", admin,
                 "--json", stdin=" ".join(map(str, tokens)))
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["num_tokens"] == 112 and reply["prompt_tokens"] == 163
    assert reply["keys"] == [k.hex() for k in keys[:7]]
    for bad_tokens, bad_ns in (("1 2 x", json.dumps(NS)), ("[-1]", json.dumps(NS)),
                               ("1 2", '{"model": "m"}'), ("1 2", "not json")):
        out = kvpool("lookup", "--tokens-file", "-", "--namespace", bad_ns, "--admin", admin,
                     stdin=bad_tokens)
        assert out.returncode == 2 and "configuration error" in out.stderr, out.stderr
    missing = kvpool("lookup", "--tokens-file", str(tmp_path / "nope"), "--namespace",
                     json.dumps(NS), "--admin", admin)
    assert missing.returncode == 2 and "nope" in missing.stderr


def test_pin_and_unpin_on_the_node_that_holds_the_chunk(cluster2: LocalCluster) -> None:
    keys = ChunkHasher(Namespace(**NS)).keys([9] * 16 * 3)  # type: ignore[arg-type]
    with Client(cluster2.seeds) as c:
        c.put_many(keys[:2], [bytes(64)] * 2)
    admin = cluster2.nodes[0].admin_url
    out = kvpool("pin", keys[0].hex(), keys[1].hex(), "--admin", admin, "--json")
    assert out.returncode == 0, out.stderr
    holders = json.loads(out.stdout)["nodes"]
    assert all(len(holders[k.hex()]) == 1 for k in keys[:2])  # replication 1: one owner each
    for node in cluster2.nodes:
        for key in keys[:2]:
            status, info = http_json(f"{node.admin_url}/v1/chunks/{key.hex()}")
            held = node.node_id in holders[key.hex()]
            assert status == (200 if held else 404)
            if held:
                assert info["pinned"] is True
    out = kvpool("unpin", keys[0].hex(), "--admin", admin)
    assert out.returncode == 0 and "unpinned on" in out.stdout
    owner = next(n for n in cluster2.nodes if n.node_id in holders[keys[0].hex()])
    assert http_json(f"{owner.admin_url}/v1/chunks/{keys[0].hex()}")[1]["pinned"] is False
    # a key no node holds: exit 1; a malformed key: refused (exit 2)
    absent = kvpool("pin", keys[2].hex(), "--admin", admin)
    assert absent.returncode == 1 and "in no node's DRAM tier" in absent.stdout
    assert kvpool("pin", "zz", "--admin", admin).returncode == 2


def test_mutating_commands_send_the_admin_token() -> None:
    node = start_node("--no-ssd", "--dram-capacity", "16MiB", "--admin-token", "s3cret")
    try:
        key = ChunkHasher(Namespace(**NS)).keys([3] * 16)[0]  # type: ignore[arg-type]
        with Client(node.url) as c:
            c.put(key, bytes(64))
        refused = kvpool("pin", key.hex(), "--admin", node.admin_url)
        assert refused.returncode == 2 and "HTTP 401" in refused.stderr
        out = kvpool("pin", key.hex(), "--admin", node.admin_url, "--token", "s3cret")
        assert out.returncode == 0, out.stderr
        # drain on a standalone node is refused by the node (no cluster source), not by auth
        drain = kvpool("drain", "node-x", "--admin", node.admin_url, "--token", "s3cret")
        # "HTTP 401", not "401": the admin URL's port may hold those digits (40165 did)
        assert drain.returncode == 2 and "HTTP 401" not in drain.stderr
    finally:
        node.stop()


def test_bench_lists_and_runs_benchmarks() -> None:
    listing = kvpool("bench")
    assert listing.returncode == 0
    for name in ("throughput", "tiers", "cluster", "metrics_overhead", "placement_sim"):
        assert name in listing.stdout
    assert "_procs" not in listing.stdout
    help_run = kvpool("bench", "placement_sim", "--help")
    assert help_run.returncode == 0 and "usage" in help_run.stdout
    unknown = kvpool("bench", "nope")
    assert unknown.returncode == 2 and "no benchmark 'nope'" in unknown.stderr


def test_bench_runs_the_checkouts_benchmarks_from_any_directory(tmp_path: Path) -> None:
    """The benchmarks are not installed: from outside the checkout, ``kvpool bench`` finds
    the one kvpool is installed from (pip install -e), and the benchmark and what it
    starts import ``bench`` from there."""
    done = subprocess.run([sys.executable, "-m", "kvpool.cli", "bench", "placement_sim",
                           "--sizes", "3", "--keys", "2000", "--no-domains",
                           "--out", str(tmp_path / "p.json")],
                          capture_output=True, text=True, timeout=120, check=False,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "p.json").is_file()  # its flags' paths: the caller's directory
    from kvpool.cli.ops import bench_root

    assert bench_root() == ROOT
