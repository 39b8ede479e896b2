"""Membership in a real etcd (Debian's etcd-server 3.4) with real node processes:
registration, join under load, drain with hand-off, lease expiry of a killed node, and
an etcd with auth on (nodes log in; a node without the password is refused)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.cli.local_cluster import LocalCluster, LocalEtcd
from kvpool.client import AsyncClient, Client
from kvpool.client._node import NodeClient
from kvpool.placement.cluster_map import ClusterMap, NodeInfo
from kvpool.server.cluster.etcd import EtcdSource
from kvpool.server.cluster.etcd_auth import enable_auth
from tests.cluster.test_cluster import value_for
from tests.conftest import http_json, start_node

FAST = ["--no-ssd", "--dram-capacity", "64MiB"]


pytestmark = pytest.mark.slow  # etcd and nodes joining, draining and dying


def call(url: str, body: object | None = None) -> tuple[int, Any]:
    """GET, or POST ``body``."""
    return http_json(url, "POST" if body is not None else "GET", body)


def served_map(admin_url: str) -> ClusterMap:
    _, data = call(f"{admin_url}/v1/cluster")
    return ClusterMap.from_dict({k: data[k] for k in ("epoch", "replication", "fallbacks",
                                                      "nodes")})


def wait_for(predicate: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    if shutil.which("etcd") is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have etcd (.ci/run installs etcd-server)")
        pytest.skip("no etcd binary (apt-get install etcd-server)")
    with LocalEtcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


def test_nodes_register_and_share_one_map(etcd: LocalEtcd, tmp_path: Path) -> None:
    with LocalCluster(3, replication=2, data_dir=tmp_path, etcd=etcd.endpoint,
                      etcd_prefix="/kvpool/t-register", serve_args=FAST) as cluster:
        wait_for(lambda: len({served_map(n.admin_url).epoch for n in cluster.nodes}) == 1,
                 "every node to see the same epoch")
        maps = [served_map(n.admin_url) for n in cluster.nodes]
        assert maps[0] == maps[1] == maps[2]
        assert [(n.id, n.state.value) for n in maps[0].nodes] == \
            [("n0", "up"), ("n1", "up"), ("n2", "up")]
        assert maps[0].replication == 2 and maps[0].epoch > 1
        # a static-only change is refused with a clear error on a static node; here it works,
        # and bad requests get the stable JSON error shape
        status, reply = call(f"{cluster.nodes[0].admin_url}/v1/cluster/drain", {"id": "nope"})
        assert status == 400 and "not in the cluster map" in reply["error"]["message"]
        status, reply = call(f"{cluster.nodes[0].admin_url}/v1/cluster/join", {"di": "x"})
        assert status == 400 and reply["error"]["type"] == "bad_request"


async def test_join_then_drain_under_load(etcd: LocalEtcd, tmp_path: Path) -> None:
    with LocalCluster(3, replication=2, data_dir=tmp_path, etcd=etcd.endpoint,
                      etcd_prefix="/kvpool/t-join", serve_args=FAST) as cluster:
        written: dict[bytes, bytes] = {}
        errors: list[BaseException] = []
        counts = {"reads": 0, "misses": 0, "wrong": 0}
        stop = asyncio.Event()

        async def worker(client: AsyncClient, seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                try:
                    if rng.random() < 0.3 or len(written) < 50:
                        keys = [rng.randbytes(16) for _ in range(8)] if len(written) < 3000 \
                            else rng.sample(list(written), 8)
                        await client.put_many(keys, [value_for(k, 1024) for k in keys])
                        written.update((k, value_for(k, 1024)) for k in keys)
                    else:
                        keys = rng.sample(list(written), 16)
                        for key, got in zip(keys, await client.get_many(keys), strict=True):
                            counts["reads"] += 1
                            if got is None:
                                counts["misses"] += 1
                            elif bytes(got) != written[key]:
                                counts["wrong"] += 1
                except Exception as exc:  # every error is a failure here
                    errors.append(exc)
                    return

        async with AsyncClient(cluster.seeds, timeout=5) as client:
            tasks = [asyncio.create_task(worker(client, s)) for s in range(3)]
            await asyncio.sleep(1.0)
            before = served_map(cluster.nodes[0].admin_url)
            await asyncio.to_thread(cluster.add_node)  # n3 registers and joins by itself
            await asyncio.to_thread(wait_for, lambda: "n3" in served_map(
                cluster.nodes[1].admin_url).by_id, "n3 in the map")
            after = served_map(cluster.nodes[1].admin_url)
            await asyncio.sleep(1.0)

            # the keys the joiner now owns are the ones the ring says move to it
            probe = [os.urandom(16) for _ in range(4000)]
            moved = sum("n3" in o[:2] for o in after.preference(probe)) / len(probe)
            assert 0.35 < moved < 0.65  # r=2 of 4 equal nodes: 1/2 of keys have n3 as an owner
            fresh = [os.urandom(16) for _ in range(400)]
            await client.put_many(fresh, [value_for(k, 64) for k in fresh])
            assert client.epoch >= after.epoch > before.epoch
            direct = NodeClient("127.0.0.1", cluster.nodes[3].data_port)
            direct.epoch = client.epoch
            held = await direct.exists(b"".join(fresh))
            direct.close()
            assert [c != 0 for c in held] == ["n3" in o[:2] for o in after.preference(fresh)]

            # drain n0: it hands its DRAM chunks over and leaves the map
            status, reply = await asyncio.to_thread(
                call, f"{cluster.nodes[2].admin_url}/v1/cluster/drain", {"id": "n0"})
            assert status == 200, reply
            assert reply["nodes"][0]["state"] == "draining"

            def drained() -> bool:
                _, stats = call(f"{cluster.nodes[0].admin_url}/v1/stats")
                return bool(stats["drain"]["state"] == "done")

            await asyncio.to_thread(wait_for, drained, "n0's hand-off")
            _, stats = await asyncio.to_thread(call, f"{cluster.nodes[0].admin_url}/v1/stats")
            progress = stats["drain"]
            assert progress["chunks_moved"] > 0 and progress["chunks_failed"] == 0
            await asyncio.to_thread(wait_for, lambda: "n0" not in served_map(
                cluster.nodes[1].admin_url).by_id, "n0 to leave the map")
            await asyncio.sleep(1.0)
            stop.set()
            await asyncio.gather(*tasks)
            assert errors == []
            assert counts["wrong"] == 0 and client.num_corrupt == 0
            assert counts["misses"] == 0, counts
            # everything written is still there without n0, and lookups agree
            cluster.kill(0)
            keys = list(written)
            got = await client.get_many(keys)
            assert [bytes(v) if v is not None else None for v in got] == \
                [written[k] for k in keys]
            assert await client.lookup(keys[:500]) == 500


def test_nodes_register_their_failure_domains_and_a_relabelled_node_moves(
        etcd: LocalEtcd, tmp_path: Path) -> None:
    with LocalCluster(2, replication=2, data_dir=tmp_path, etcd=etcd.endpoint,
                      etcd_prefix="/kvpool/t-labels", host_ids=["box-a", "box-b"],
                      serve_args=[*FAST, "--rack", "r1", "--zone", "z1"]) as cluster:
        cmap = served_map(cluster.nodes[0].admin_url)
        assert [(n.host, n.rack, n.zone) for n in cmap.nodes] == \
            [("box-a", "r1", "z1"), ("box-b", "r1", "z1")]
        cluster.serve_args = [*FAST, "--rack", "r2", "--zone", "z1"]
        cluster.restart(1)  # box-b was moved to another rack
        wait_for(lambda: served_map(cluster.nodes[0].admin_url).by_id["n1"].rack == "r2",
                 "n1's entry to move to rack r2")
        cmap = served_map(cluster.nodes[0].admin_url)
        assert cmap.by_id["n0"].rack == "r1" and cmap.by_id["n1"].state == "up"
        # a node that would put box-a in a second rack is refused (the map would be
        # unreadable for every node): it does not start, and says why
        import subprocess
        import sys

        refused = subprocess.run(
            [sys.executable, "-m", "kvpool.server", "serve", *FAST, "--etcd", etcd.endpoint,
             "--etcd-prefix", "/kvpool/t-labels", "--node-id", "n9", "--host-id", "box-a",
             "--rack", "r9", "--data-port", "0", "--admin-port", "0",
             "--data-dir", str(tmp_path / "n9")],
            capture_output=True, text=True, timeout=60, check=False)
        assert refused.returncode == 2, refused.stderr
        assert "cannot join with these labels: host 'box-a' is in two places" in \
            refused.stderr
        assert "n9" not in served_map(cluster.nodes[0].admin_url).by_id


def test_serve_nodes_joins_an_etcd_cluster_as_one_host(etcd: LocalEtcd, tmp_path: Path) -> None:
    """``kvpool serve --nodes 2 --etcd``: two nodes register as ``<host>-n0/1`` with the
    host label given, and a node of another host (its own ``kvpool serve``) joins beside
    them: with replication 2 every key has a copy off the two-node host."""
    from tests.cluster.test_domains import ServeNodes, spread_keys

    prefix = "/kvpool/t-serve-nodes"
    serve = ServeNodes(tmp_path / "box", 2, *FAST, "--etcd", etcd.endpoint, "--etcd-prefix",
                       prefix, "--replication", "2", "--host-id", "box-1",
                       "--log-level", "warning")
    other = None
    try:
        seeds = serve.wait_for(r"cluster ready, seeds (\S+)")[1]
        other = start_node(*FAST, "--etcd", etcd.endpoint, "--etcd-prefix", prefix,
                           "--replication", "2", "--host-id", "box-2", "--node-id", "lone")
        admin = serve.wait_for(r" admin=(\S+)")[1]
        wait_for(lambda: len(served_map(admin).ring.nodes) == 3, "three nodes up")
        cmap = served_map(admin)
        assert {(n.id, n.host) for n in cmap.nodes} == \
            {("box-1-n0", "box-1"), ("box-1-n1", "box-1"), ("lone", "box-2")}
        keys = spread_keys(200)
        assert all("lone" in owners[:2] for owners in cmap.preference(keys))
        with Client(seeds) as c:
            c.put_many(keys, [value_for(k) for k in keys])
            assert c.get_many(keys) == [value_for(k) for k in keys]
    finally:
        if other is not None:
            other.stop()
        serve.stop()


def test_a_killed_node_is_marked_down_when_its_lease_expires(etcd: LocalEtcd,
                                                             tmp_path: Path) -> None:
    with LocalCluster(3, replication=2, data_dir=tmp_path, etcd=etcd.endpoint,
                      etcd_prefix="/kvpool/t-lease", lease_ttl_s=2,
                      serve_args=FAST) as cluster:
        cluster.kill(1)
        # the lease TTL (2 s) plus etcd's expiry sweep and the watch, with room for a
        # loaded machine: the bound is the wait's, not an assert on how long it took
        wait_for(lambda: served_map(cluster.nodes[0].admin_url).by_id["n1"].state == "down",
                 "n1 to be marked down", timeout=30)
        cmap = served_map(cluster.nodes[2].admin_url)
        assert "n1" not in cmap.ring.nodes  # a down node owns nothing
        cluster.restart(1)  # and it comes back up when it registers again
        wait_for(lambda: served_map(cluster.nodes[0].admin_url).by_id["n1"].state == "up",
                 "n1 to be up again")


def test_cli_status_and_drain_follow_the_hand_off(etcd: LocalEtcd, tmp_path: Path) -> None:
    import subprocess
    import sys

    with LocalCluster(2, replication=1, data_dir=tmp_path, etcd=etcd.endpoint,
                      etcd_prefix="/kvpool/t-cli", serve_args=FAST) as cluster:
        for node in cluster.nodes:  # both have seen both registrations
            wait_for(lambda n=node: len(served_map(n.admin_url).ring.nodes) == 2, "the map")
        keys = [os.urandom(16) for _ in range(300)]
        with Client(cluster.seeds) as client:
            client.put_many(keys, [value_for(k, 4096) for k in keys])
            assert all(client.exists_many(keys))
        on_n1 = sum(o[0] == "n1" for o in served_map(cluster.nodes[0].admin_url).preference(keys))
        kvpool = [sys.executable, "-m", "kvpool.cli", "cluster"]
        status = subprocess.run([*kvpool, "status", "--json", "--admin",
                                 cluster.nodes[0].admin_url],
                                capture_output=True, text=True, timeout=60, check=True)
        report = json.loads(status.stdout)
        assert [n["id"] for n in report["cluster"]["nodes"]] == ["n0", "n1"]
        assert sum(s["num_objects"] for s in report["stats"].values()) == len(keys)

        drain = subprocess.run([*kvpool, "drain", "n1", "--json", "--interval", "0.1",
                                "--wait", "60", "--admin", cluster.nodes[0].admin_url],
                               capture_output=True, text=True, timeout=90, check=False)
        assert drain.returncode == 0, drain.stderr
        progress = json.loads(drain.stdout)
        assert progress["state"] == "done"
        assert progress["chunks_moved"] == progress["chunks_total"] == on_n1 > 0
        assert progress["bytes_moved"] == on_n1 * 4096  # payload bytes
        with Client(cluster.nodes[0].seed) as client:  # n0 alone now has every chunk
            got = client.get_many(keys)
            assert [bytes(v) if v is not None else None for v in got] == \
                [value_for(k, 4096) for k in keys]

        refused = subprocess.run([*kvpool, "drain", "n9", "--admin", cluster.nodes[0].admin_url],
                                 capture_output=True, text=True, timeout=60, check=False)
        assert refused.returncode == 2 and "n9" in refused.stderr


# -- etcd with auth ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def etcd_with_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A second etcd with auth on: a root user, and ``kvpool`` allowed /kvpool/auth/ only;
    (its endpoint, the file holding kvpool's password)."""
    if shutil.which("etcd") is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have etcd (.ci/run installs etcd-server)")
        pytest.skip("no etcd binary (apt-get install etcd-server)")
    folder = tmp_path_factory.mktemp("etcd-auth")
    password = folder / "etcd-password"
    password.write_text("kvpool-etcd-password-1\n")
    with LocalEtcd(folder / "data") as server:
        assert enable_auth(server.endpoint, root_password="root-password-1", user="kvpool",
                           password="kvpool-etcd-password-1", prefix="/kvpool/auth")
        assert not enable_auth(server.endpoint, root_password="x", user="kvpool",
                               password="y", prefix="/kvpool/auth")  # already on: no-op
        yield server.endpoint, password


def test_nodes_log_in_to_an_etcd_with_auth_and_others_are_refused(
        etcd_with_auth: tuple[str, Path]) -> None:
    endpoint, password = etcd_with_auth
    flags = [*FAST, "--etcd", endpoint, "--etcd-prefix", "/kvpool/auth"]
    node = start_node(*flags, "--etcd-user", "kvpool",
                      env={"KVPOOL_ETCD_PASSWORD_FILE": str(password)})
    try:
        cmap = served_map(node.admin_url)
        assert [n.state for n in cmap.nodes] == ["up"] and cmap.epoch > 1
        with Client(node.url) as kv:
            kv.put(b"e" * 16, b"through an etcd with auth")
            assert kv.get(b"e" * 16) == b"through an etcd with auth"
        for extra, env, why in [
                ([], {}, "user name is empty"),  # no credentials: etcd refuses
                (["--etcd-user", "kvpool"], {"KVPOOL_ETCD_PASSWORD": "wrong-password"},
                 "refused user 'kvpool'"),
                (["--etcd-prefix", "/kvpool/other", "--etcd-user", "kvpool"],  # not its prefix
                 {"KVPOOL_ETCD_PASSWORD_FILE": str(password)}, "permission denied")]:
            with pytest.raises(RuntimeError, match=why):
                start_node(*flags, *extra, env=env, timeout=20)
        assert [n.id for n in served_map(node.admin_url).nodes] == [cmap.nodes[0].id]
    finally:
        node.stop()


async def test_a_stale_etcd_token_is_renewed(etcd_with_auth: tuple[str, Path]) -> None:
    endpoint, password = etcd_with_auth
    source = EtcdSource(endpoint, prefix="/kvpool/auth/renew", user="kvpool",
                        password=password.read_text().strip())
    me = NodeInfo(id="solo", data="127.0.0.1:1", admin="127.0.0.1:2")
    try:
        first = await source.start(me, lambda cmap: None)
        source.gateway._token = "stale.token"  # what etcd says after a restart or 5 idle minutes
        await source.change("join", "other", {"data": "127.0.0.1:3", "admin": "127.0.0.1:4"})
        after = await source.read()
        assert sorted(after.by_id) == ["other", "solo"] and after.epoch > first.epoch
    finally:
        await source.stop()
