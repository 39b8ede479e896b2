"""GET /metrics on a real node: OpenTelemetry's Prometheus reader over the data path's counters."""

from __future__ import annotations

import os
import re
import urllib.error
import urllib.request

from kvpool.client import Client
from kvpool.server.admin.metrics import HISTOGRAM_NAME, METRICS, metrics_table
from tests.conftest import ROOT, NodeProcess, put_raw, start_node

SAMPLE = re.compile(r"^([a-z_]+)(\{[^}]*\})? (\S+)$")


def scrape(node: NodeProcess) -> dict[str, float]:
    with urllib.request.urlopen(f"{node.admin_url}/metrics", timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            m = SAMPLE.match(line)
            assert m, line
            samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return samples


def test_metrics_count_what_the_node_did() -> None:
    node = start_node("--dram-capacity", "64MiB")
    try:
        keys = [os.urandom(16) for _ in range(7)]
        with Client(node.url, shm=False) as c, Client(node.url, shm=True) as fast:
            c.put_many(keys, [b"x" * 1000] * 7, num_tokens=256)
            assert all(v is not None for v in c.get_many(keys))
            assert c.get(os.urandom(16)) is None
            assert c.lookup(keys) == 7
            assert fast.get_many(keys[:3]) == [b"x" * 1000] * 3
        put_raw(node, os.urandom(16), bytes(100))  # not an envelope: CORRUPT
        m = scrape(node)
        assert m['kvpool_requests_total{op="put",status="ok"}'] == 1
        assert m['kvpool_requests_total{op="put",status="corrupt"}'] == 1
        assert m['kvpool_requests_total{op="get",status="ok"}'] == 2
        assert m['kvpool_request_keys_total{op="get"}'] == 8
        # read through the arena index, reported in one TOUCH (as the fast client closed)
        assert m['kvpool_requests_total{op="touch",status="ok"}'] == 1
        assert 'kvpool_requests_total{op="get_shm",status="ok"}' not in m
        assert m["kvpool_prefill_tokens_served_total"] == 10 * 256
        assert m["kvpool_lookup_chunks_found_total"] == 7
        assert m['kvpool_tier_hits_total{tier="dram"}'] == 10
        assert m['kvpool_tier_misses_total{tier="dram"}'] == 1
        assert m['kvpool_tier_objects{tier="dram"}'] == 7
        assert m['kvpool_sent_bytes_total{path="tcp"}'] == 7 * (1000 + 64)
        assert m['kvpool_sent_bytes_total{path="shm"}'] == 3 * (1000 + 64)
        assert m['kvpool_tier_read_bytes_total{tier="dram"}'] == 10 * (1000 + 64)  # both paths
        assert m['kvpool_tier_capacity_bytes{tier="dram"}'] == 64 << 20
        assert m['kvpool_cluster_nodes{state="up"}'] == 1
        assert m[f'{HISTOGRAM_NAME}_count{{op="get"}}'] == 2
        assert m[f'{HISTOGRAM_NAME}_bucket{{le="+Inf",op="get"}}'] == 2
        assert 0 < m[f'{HISTOGRAM_NAME}_sum{{op="get"}}'] < 5
        # every documented metric is exported
        names = {key.split("{")[0] for key in m}
        missing = [x.prometheus_name for x in METRICS if x.prometheus_name not in names]
        assert not missing
    finally:
        node.stop()


def test_metrics_can_be_turned_off() -> None:
    node = start_node("--no-metrics", "--no-ssd", "--dram-capacity", "16MiB")
    try:
        try:
            urllib.request.urlopen(f"{node.admin_url}/metrics", timeout=10)
        except urllib.error.HTTPError as exc:
            assert exc.code == 404
            assert b"--no-metrics" in exc.read()
        else:
            raise AssertionError("/metrics answered with metrics off")
    finally:
        node.stop()


def test_readme_metrics_table_is_current() -> None:
    doc = (ROOT / "docs" / "observability.md").read_text()
    assert metrics_table() in doc, "regenerate docs/observability.md's table: metrics_table()"


def test_one_hit_and_miss_count_on_every_path_and_in_every_view() -> None:
    """A hit is a chunk a read got, from any tier, by any path; ``kvpool stats``, ``kvpool
    status``, /v1/stats and /metrics show the same counts (status once counted TCP GETs
    only, and showed '-' for a node read through shared memory)."""
    import json
    import subprocess
    import sys
    import urllib.request

    node = start_node("--dram-capacity", "4MiB")
    keys = [os.urandom(16) for _ in range(6)]
    try:
        with Client(node.url, shm=False) as tcp:
            tcp.put_many(keys, [k * 64 for k in keys])
            assert tcp.get(keys[0]) == keys[0] * 64  # TCP: a hit
            assert tcp.get(os.urandom(16)) is None  # TCP: a miss
        with Client(node.url, shm=True) as index:  # the arena index: no request at all
            assert index.get(keys[1]) == keys[1] * 64
        with Client(node.url, shm=True, shm_index=False) as get_shm:  # GET_SHM
            assert get_shm.get_many([keys[2], os.urandom(16)]) == [keys[2] * 64, None]
        with urllib.request.urlopen(f"{node.admin_url}/v1/admin/flush", data=b"{}",
                                    timeout=30):
            pass
        with urllib.request.urlopen(f"{node.admin_url}/v1/admin/evict",
                                    data=json.dumps({"tier": "dram"}).encode(), timeout=30):
            pass
        with Client(node.url, shm=False) as tcp:  # promoted from the SSD tier: a hit
            assert tcp.get(keys[3]) == keys[3] * 64
        with urllib.request.urlopen(f"{node.admin_url}/v1/stats", timeout=10) as reply:
            stats = json.load(reply)
        assert (stats["hits"], stats["misses"]) == (4, 2)
        assert stats["tiers"]["dram"]["misses"] >= 3  # the tier's own count is another thing
        metrics = scrape(node)
        assert metrics["kvpool_hits_total"] == 4 and metrics["kvpool_misses_total"] == 2

        def cli(*args: str) -> str:
            done = subprocess.run([sys.executable, "-m", "kvpool.cli", *args, "--admin",
                                   node.admin_url], capture_output=True, text=True, timeout=60,
                                  check=False, env={**os.environ, "COLUMNS": "200"})
            assert done.returncode == 0, done.stderr
            return done.stdout

        assert re.search(r"hit rate\W+66\.7%", cli("stats"))
        assert "66.7%" in cli("status")
    finally:
        node.stop()
