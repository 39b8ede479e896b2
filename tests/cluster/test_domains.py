"""Failure domains on real node processes: copies of a key on distinct hosts, a whole host
killed with nothing lost, a node refused whose labels disagree with its map, and
``kvpool serve --nodes N`` (N nodes of one host)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from kvpool.cli.local_cluster import LocalCluster, free_port_run
from kvpool.client import AsyncClient, Client
from kvpool.placement.cluster_map import ClusterMap, NodeInfo
from kvpool.protocol.errors import ConfigError
from kvpool.server.cluster.membership import Membership, StaticSource
from tests.cluster.test_cluster import FAST, RunningCommand, admin_json, node_exists, value_for

HOSTS = ["host-a", "host-a", "host-b", "host-b", "host-c", "host-c"]


def spread_keys(n: int) -> list[bytes]:
    """Keys all over the ring (a key's place is its first 8 bytes), the same each run."""
    return [xxhash.xxh3_128(b"domains %d" % i).digest() for i in range(n)]


async def test_two_copies_never_share_a_host_and_a_killed_host_loses_nothing(
        tmp_path: Path) -> None:
    """6 nodes on 3 labelled hosts, replication 2: every key is held by two nodes of two
    hosts (asked of each node, not of the map), and with both nodes of one host SIGKILLed
    every key still reads back, byte for byte."""
    keys = spread_keys(1500)
    with LocalCluster(6, replication=2, data_dir=tmp_path, serve_args=FAST,
                      host_ids=HOSTS) as cluster:
        served = admin_json(f"{cluster.nodes[0].admin_url}/v1/cluster")
        assert [n["host"] for n in served["nodes"]] == HOSTS  # type: ignore[index]
        async with AsyncClient(cluster.seeds[0]) as writer:
            await writer.put_many(keys, [value_for(k) for k in keys])
        held = [await node_exists(cluster, i, keys) for i in range(6)]
        holders = [[i for i in range(6) if held[i][k]] for k in range(len(keys))]
        assert all(len(h) == 2 for h in holders), "a key is not on exactly two nodes"
        same_host = [keys[k].hex() for k, h in enumerate(holders)
                     if HOSTS[h[0]] == HOSTS[h[1]]]
        assert same_host == [], f"{len(same_host)} keys have both copies on one host"
        # a host's nodes held copies of many keys: its loss is a real test
        on_b = sum(1 for h in holders if {2, 3} & set(h))
        assert on_b > len(keys) / 2
        cluster.kill(2)
        cluster.kill(3)
        async with AsyncClient(cluster.seeds[0]) as reader:
            got = await reader.get_many(keys)
        missing = sum(1 for v in got if v is None)
        wrong = sum(1 for k, v in zip(keys, got, strict=True)
                    if v is not None and bytes(v) != value_for(k))
        assert (missing, wrong) == (0, 0)


async def test_a_node_whose_labels_disagree_with_its_static_map_is_refused(
        tmp_path: Path) -> None:
    cmap = ClusterMap(epoch=1, replication=2, nodes=(
        NodeInfo(id="n0", data="127.0.0.1:7700", host="box-1", rack="r1"),
        NodeInfo(id="n1", data="127.0.0.1:7702")))
    path = tmp_path / "cluster.toml"
    path.write_text(cmap.to_toml())

    async def start(node_id: str, labels: dict[str, str]) -> Membership:
        membership = Membership(StaticSource(file=str(path)))
        await membership.start(node_id, ("127.0.0.1", 7700), ("127.0.0.1", 7701), labels)
        return membership

    assert (await start("n0", {"host": "box-1", "rack": "r1", "zone": ""})).node_id == "n0"
    # n1 has no host label: it is on its data address's host
    assert (await start("n1", {"host": "127.0.0.1"})).node_id == "n1"
    with pytest.raises(ConfigError, match=r"--rack 'r2', but the cluster map .* puts node "
                       r"'n0' in rack 'r1'"):
        await start("n0", {"rack": "r2"})
    with pytest.raises(ConfigError, match=r"--host-id 'box-2'.* in host '127\.0\.0\.1'"):
        await start("n1", {"host": "box-2"})


async def test_a_reloaded_static_map_that_moves_this_node_is_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SIGHUP re-reads a static map: one that puts this node in another rack than its
    flags say is refused as at start (the old map stays); one that agrees is taken."""
    nodes = (NodeInfo(id="n0", data="127.0.0.1:7700", host="box-1", rack="r1"),
             NodeInfo(id="n1", data="127.0.0.1:7702", host="box-2", rack="r2"))
    path = tmp_path / "cluster.toml"
    path.write_text(ClusterMap(epoch=1, replication=2, nodes=nodes).to_toml())
    membership = Membership(StaticSource(file=str(path)))
    await membership.start("n0", ("127.0.0.1", 7700), ("127.0.0.1", 7701),
                           {"host": "box-1", "rack": "r1"})
    moved = (NodeInfo(id="n0", data="127.0.0.1:7700", host="box-1", rack="r3"), nodes[1])
    path.write_text(ClusterMap(epoch=2, replication=2, nodes=moved).to_toml())
    assert membership.reload() is False
    assert membership.epoch == 1
    assert "--rack 'r1', but the cluster map" in caplog.text
    weighed = (nodes[0], NodeInfo(id="n1", data="127.0.0.1:7702", host="box-2", rack="r2",
                                  weight=2.0))
    path.write_text(ClusterMap(epoch=3, replication=2, nodes=weighed).to_toml())
    assert membership.reload() is True
    assert membership.epoch == 3


class ServeNodes(RunningCommand):
    """``kvpool serve --nodes N`` on a run of free ports (below the ephemeral range: a
    port of one there was once taken by a connection between the check and the bind)."""

    def __init__(self, tmp_path: Path, nodes: int, *flags: str) -> None:
        data_port = free_port_run(2 * nodes)
        super().__init__("serve", "--nodes", str(nodes), "--data-dir", str(tmp_path),
                         "--data-port", str(data_port), "--admin-port", str(data_port + 1),
                         *flags)


def test_serve_nodes_runs_n_nodes_of_one_host_sharing_its_memory(tmp_path: Path) -> None:
    serve = ServeNodes(tmp_path, 2, "--no-ssd", "--dram-capacity", "64MiB",
                       "--host-id", "box-7", "--log-level", "warning")
    try:
        seeds = serve.wait_for(r"cluster ready, seeds (\S+)")[1]
        admins = [m[1] for m in (re.search(r" admin=(\S+)", line) for line in serve.lines) if m]
        assert len(admins) == 2 and seeds.count(",") == 1
        for admin in admins:
            stats = admin_json(f"{admin}/v1/stats")
            assert stats["capacity_bytes"] == 32 << 20  # half of --dram-capacity each
            served = admin_json(f"{admin}/v1/cluster")
            assert [n["host"] for n in served["nodes"]] == ["box-7", "box-7"]  # type: ignore
        keys = spread_keys(200)
        with Client(seeds) as client:  # one client spreads a batch over both nodes
            client.put_many(keys, [value_for(k) for k in keys])
            assert [bytes(v) if v is not None else None for v in client.get_many(keys)] == \
                [value_for(k) for k in keys]
        counts = [admin_json(f"{admin}/v1/stats")["num_objects"] for admin in admins]
        assert sum(counts) == len(keys) and min(counts) > len(keys) // 4  # type: ignore
    finally:
        out = serve.stop()
    assert "cluster stopped" in out


@pytest.mark.parametrize(("flags", "message"), [
    (("--peers", "127.0.0.1:7700"), "--nodes starts N nodes with a map of their own"),
    (("--dram-policy", "nope"), "dram policy must be one of"),
])
def test_serve_nodes_refuses_what_it_cannot_do_before_starting_any(
        tmp_path: Path, flags: tuple[str, ...], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvpool.cli", "serve", "--nodes", "2", "--data-dir",
         str(tmp_path), *flags], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "n0").exists()
