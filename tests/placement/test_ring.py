"""The hash ring and the cluster map: balance, minimal movement, placement rules, parsing."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.placement.cluster_map import ClusterMap, NodeInfo, NodeState
from kvpool.placement.ring import Ring, key_positions
from kvpool.protocol.errors import ConfigError, InvalidKeyError

NUM_KEYS = 1_000_000
node_ids = st.lists(st.text(min_size=1, max_size=24), min_size=8, max_size=8, unique=True)


def random_positions(seed: int, n: int = NUM_KEYS) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**64 - 1, size=n, dtype=np.uint64,
                                                endpoint=True)


def primary(ring: Ring, positions: np.ndarray, universe: list[str]) -> np.ndarray:
    """Each position's first owner, as an index into ``universe`` (not as a numpy string:
    numpy drops trailing NULs, and hypothesis does draw ids like "\\x00")."""
    where = np.array([universe.index(n) for n in ring.nodes])
    return where[ring.owner_indexes(positions, 1)[:, 0]]


@settings(max_examples=8, deadline=None)
@given(ids=node_ids, seed=st.integers(0, 2**32))
def test_eight_equal_nodes_are_balanced_within_10_percent(ids: list[str], seed: int) -> None:
    ring = Ring(dict.fromkeys(ids, 1.0))
    counts = np.bincount(ring.owner_indexes(random_positions(seed), 1)[:, 0], minlength=8)
    assert counts.sum() == NUM_KEYS
    assert counts.max() / counts.mean() <= 1.10


@settings(max_examples=6, deadline=None)
@given(ids=st.lists(st.text(min_size=1, max_size=24), min_size=3, max_size=12, unique=True),
       seed=st.integers(0, 2**32), data=st.data())
def test_join_and_leave_move_only_about_one_nth(ids: list[str], seed: int,
                                                data: st.DataObject) -> None:
    joiner = data.draw(st.text(min_size=1, max_size=24).filter(lambda s: s not in ids))
    positions = random_positions(seed, 300_000)
    before = Ring(dict.fromkeys(ids, 1.0))
    after_join = Ring(dict.fromkeys([*ids, joiner], 1.0))
    leaver = ids[data.draw(st.integers(0, len(ids) - 1))]
    after_leave = Ring({i: 1.0 for i in ids if i != leaver})
    universe = [*ids, joiner]
    old = primary(before, positions, universe)

    new = primary(after_join, positions, universe)
    moved = old != new
    assert moved.mean() <= 1.15 / (len(ids) + 1)
    assert (new[moved] == universe.index(joiner)).all(), \
        "a key moved between two nodes that both stayed"

    new = primary(after_leave, positions, universe)
    moved = old != new
    assert moved.mean() <= 1.15 / len(ids)
    assert (old[moved] == universe.index(leaver)).all(), \
        "a key moved between two nodes that both stayed"


def test_weights_set_the_share() -> None:
    ring = Ring({"small": 1.0, "big": 3.0})
    counts = np.bincount(ring.owner_indexes(random_positions(7, 400_000), 1)[:, 0], minlength=2)
    share = dict(zip(ring.nodes, counts / counts.sum(), strict=True))
    assert share["big"] == pytest.approx(0.75, abs=0.03)


def test_owners_are_distinct_clockwise_and_stable() -> None:
    ring = Ring({f"n{i}": 1.0 for i in range(5)}, width=3)
    keys = [os.urandom(16) for _ in range(2000)]
    for key, owners in zip(keys, ring.owners_many(keys, 3), strict=True):
        assert len(set(owners)) == 3
        assert ring.owners(key, 1) == owners[:1]
        # the first owner holds the first point at or after the key's position
        pos = int.from_bytes(key[:8], "big")
        at = int(np.searchsorted(ring.positions, np.uint64(pos), side="left")) % ring.num_points
        assert ring.owners_many([ring_point_key(int(ring.positions[at]))], 1)[0] == owners[:1]
    # the same ids give the same ring in any order, in any process
    again = Ring({f"n{i}": 1.0 for i in reversed(range(5))}, width=3)
    assert again.owners_many(keys, 3) == ring.owners_many(keys, 3)


def ring_point_key(position: int) -> bytes:
    return position.to_bytes(8, "big") + bytes(8)


def test_wraps_past_the_last_point() -> None:
    ring = Ring({"a": 1.0, "b": 1.0}, width=2)
    last = int(ring.positions[-1])
    first_owner = ring.owners(ring_point_key(int(ring.positions[0])), 1)
    assert ring.owners(ring_point_key(last + 1), 1) == first_owner
    assert ring.owners(ring_point_key(2**64 - 1), 1) == first_owner


def test_width_is_capped_by_node_count_and_checked() -> None:
    ring = Ring({"a": 1.0, "b": 1.0}, width=5)
    assert ring.width == 2
    with pytest.raises(ValueError, match="r must be"):
        ring.owners(bytes(16), 3)


@pytest.mark.parametrize("weights", [{}, {"a": 0.0}, {"a": -1.0}])
def test_bad_rings_are_refused(weights: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        Ring(weights)


def test_key_positions_checks_lengths() -> None:
    assert key_positions(bytes(range(16)) * 2).tolist() == [int.from_bytes(bytes(range(8)),
                                                                           "big")] * 2
    with pytest.raises(InvalidKeyError):
        key_positions(bytes(17))
    with pytest.raises(InvalidKeyError):
        key_positions([bytes(15), bytes(17)])


# -- failure domains ----------------------------------------------------------------------


def reference_owners(ring: Ring, position: int, r: int) -> list[str]:
    """The rule in placement/ring.py's docstring, written out point by point: the first
    node clockwise, then each time the first node clockwise that is new to the owners so
    far at the widest level (zone, rack, host, node) where the map still has a new one."""
    nodes, domains = ring.nodes, ring.domains
    at = int(np.searchsorted(ring.positions, np.uint64(position), side="left"))
    point_owner = ring.owners_many([ring_point_key(int(p)) for p in ring.positions], 1)
    walk = [point_owner[(at + i) % ring.num_points][0] for i in range(ring.num_points)]
    paths = {n: [domains[n][:d + 1] for d in range(3)] + [(n,)] for n in nodes}
    owners = [walk[0]]
    while len(owners) < r:
        for level in range(4):
            held = {paths[o][level] for o in owners}
            if any(paths[n][level] not in held for n in nodes):
                break
        owners.append(next(n for n in walk if paths[n][level] not in held))
    return owners


#: 12 nodes: 2 zones; zone a has racks 1 and 2, zone b rack 1 (another rack than a's 1);
#: hosts of 1 to 3 nodes
DOMAINS = {f"n{i}": domain for i, domain in enumerate([
    ("a", "1", "h0"), ("a", "1", "h0"), ("a", "1", "h1"), ("a", "2", "h2"), ("a", "2", "h2"),
    ("a", "2", "h2"), ("b", "1", "h3"), ("b", "1", "h3"), ("b", "1", "h4"), ("b", "1", "h5"),
    ("a", "2", "h6"), ("b", "1", "h7")])}


@settings(max_examples=10, deadline=None)
@given(picked=st.lists(st.sampled_from(sorted(DOMAINS)), min_size=1, max_size=12, unique=True),
       seed=st.integers(0, 2**32))
def test_owners_follow_the_spread_rule(picked: list[str], seed: int) -> None:
    """The vectorised table against the rule walked point by point, on rings of any subset
    of DOMAINS (so also rings with one zone, one rack, one host)."""
    ring = Ring(dict.fromkeys(picked, 1.0), width=4, vnodes_per_weight=16,
                domains={n: DOMAINS[n] for n in picked})
    positions = random_positions(seed, 200)
    table = ring.owner_indexes(positions, ring.width)
    for position, row in zip(positions, table, strict=True):
        assert [ring.nodes[i] for i in row] == reference_owners(ring, int(position), ring.width)


def test_without_domains_owners_are_the_first_distinct_nodes_clockwise() -> None:
    """No labels (or all nodes in one zone and rack, each its own host): the ring places
    every key exactly as it did before failure domains existed."""
    ids = {f"n{i}": 1.0 for i in range(6)}
    plain = Ring(ids, width=3, vnodes_per_weight=64)
    labelled = Ring(ids, width=3, vnodes_per_weight=64,
                    domains={n: ("z", "r", f"host-{n}") for n in ids})
    positions = random_positions(3, 2000)
    assert np.array_equal(plain.owner_indexes(positions, 3), labelled.owner_indexes(positions, 3))
    for position, row in zip(positions[:200], plain.owner_indexes(positions[:200], 3),
                             strict=True):
        at = int(np.searchsorted(plain.positions, position, side="left"))
        walk = [plain.owner_indexes(plain.positions[(at + i) % plain.num_points:][:1], 1)[0, 0]
                for i in range(plain.num_points)]
        assert row.tolist() == list(dict.fromkeys(walk))[:3]


def test_copies_go_to_distinct_hosts_racks_and_zones_as_far_as_the_map_allows() -> None:
    positions = random_positions(5, 50_000)
    # 6 nodes on 3 hosts (two a host): 2 copies always on 2 hosts, 3 on 3
    hosts = {f"n{i}": ("", "", f"h{i // 2}") for i in range(6)}
    ring = Ring(dict.fromkeys(hosts, 1.0), width=4, domains=hosts)
    table = ring.owner_indexes(positions, 4)
    host_of = np.array([int(hosts[n][2][1:]) for n in ring.nodes])
    assert (host_of[table[:, 0]] != host_of[table[:, 1]]).all()
    assert (np.sort(host_of[table[:, :3]], axis=1) == [0, 1, 2]).all()
    # the fourth place has no new host left: a node not yet chosen
    assert all(len(set(row)) == 4 for row in table.tolist())
    # 3 zones of unequal size, 12 nodes: 3 copies always one a zone
    zones = {f"n{i}": ("abc"[i % 3] if i < 9 else "a", "", f"h{i}") for i in range(12)}
    ring = Ring(dict.fromkeys(zones, 1.0), width=3, domains=zones)
    zone_of = np.array(["abc".index(zones[n][0]) for n in ring.nodes])
    assert (np.sort(zone_of[ring.owner_indexes(positions, 3)], axis=1) == [0, 1, 2]).all()


def test_a_host_that_leaves_moves_only_the_copies_it_held() -> None:
    """Keys without a copy on the host keep their owners, in order; keys with one get one
    new owner in its place (as sets: the minimum)."""
    domains = {f"n{i}": (f"z{i % 3}", f"r{i % 6}", f"h{i % 12}") for i in range(24)}
    before = Ring(dict.fromkeys(domains, 1.0), width=3, domains=domains)
    gone = {n for n, d in domains.items() if d[2] == "h5"}
    after = Ring({n: 1.0 for n in domains if n not in gone}, width=3,
                 domains={n: d for n, d in domains.items() if n not in gone})
    positions = random_positions(9, 100_000)
    old = np.array(before.nodes)[before.owner_indexes(positions, 3)]
    new = np.array(after.nodes)[after.owner_indexes(positions, 3)]
    held = np.isin(old, list(gone))
    untouched = ~held.any(axis=1)
    assert (old[untouched] == new[untouched]).all()
    moved = sum(len(set(n) - set(o)) for o, n in zip(old.tolist(), new.tolist(), strict=True))
    assert moved == held.sum()


# -- cluster map ------------------------------------------------------------------------


def three_nodes(**kw: object) -> ClusterMap:
    nodes = tuple(NodeInfo(id=f"n{i}", data=f"127.0.0.1:{7700 + 2 * i}",
                           admin=f"127.0.0.1:{7701 + 2 * i}") for i in range(3))
    return ClusterMap(epoch=3, nodes=nodes, **kw)  # type: ignore[arg-type]


def test_map_round_trips_through_dict_and_toml(tmp_path: Path) -> None:
    cmap = three_nodes(replication=2)
    assert ClusterMap.from_dict(cmap.to_dict()) == cmap
    path = tmp_path / "cluster.toml"
    path.write_text(cmap.to_toml())
    assert ClusterMap.from_toml(path) == cmap


def test_labels_round_trip_and_a_node_without_host_is_on_its_address(tmp_path: Path) -> None:
    nodes = (NodeInfo(id="a", data="10.0.0.1:7700", host="box-1", rack="r1", zone="z1"),
             NodeInfo(id="b", data="10.0.0.1:7710", rack="r1", zone="z1"),
             NodeInfo(id="c", data="10.0.0.2:7700"))
    cmap = ClusterMap(epoch=2, nodes=nodes, replication=2)
    assert [n.domain for n in cmap.nodes] == [("z1", "r1", "box-1"), ("z1", "r1", "10.0.0.1"),
                                             ("", "", "10.0.0.2")]
    assert cmap.ring.domains == {n.id: n.domain for n in nodes}
    assert "host" not in nodes[2].to_dict()  # an unlabelled entry reads as before labels
    path = tmp_path / "cluster.toml"
    path.write_text(cmap.to_toml())
    assert ClusterMap.from_toml(path) == cmap
    assert ClusterMap.from_dict(cmap.to_dict()) == cmap
    # two nodes on one address: two copies of a key never both on it
    same_host = ClusterMap(epoch=2, replication=2, nodes=(
        NodeInfo(id="a", data="10.0.0.1:7700"), NodeInfo(id="b", data="10.0.0.1:7710"),
        NodeInfo(id="c", data="10.0.0.2:7700")))
    for pref in same_host.preference([os.urandom(16) for _ in range(500)]):
        assert "c" in pref[:2]


def test_peers_form() -> None:
    cmap = ClusterMap.from_peers("127.0.0.1:7700, 127.0.0.1:7710", replication=2)
    assert [n.id for n in cmap.nodes] == ["127.0.0.1:7700", "127.0.0.1:7710"]
    assert cmap.nodes[1].admin == "127.0.0.1:7711"
    assert cmap.epoch == 1 and cmap.replication == 2


def test_only_up_nodes_own_keys_and_accepts_follows_the_preference_list() -> None:
    keys = [os.urandom(16) for _ in range(500)]
    cmap = three_nodes(replication=1, fallbacks=0)
    prefs = cmap.preference(keys)
    for key, pref in zip(keys, prefs, strict=True):
        assert len(pref) == 1
        assert cmap.accepts(pref[0], [key])
        assert not any(cmap.accepts(n, [key]) for n in ("n0", "n1", "n2") if n != pref[0])
    draining = ClusterMap(epoch=4, nodes=(*cmap.nodes[:2], NodeInfo(
        id="n2", data="127.0.0.1:7704", state=NodeState.DRAINING)))
    assert {p[0] for p in draining.preference(keys)} == {"n0", "n1"}
    assert not draining.accepts("n2", keys[:1])
    assert not cmap.accepts("nobody", keys[:1])


@pytest.mark.parametrize(("data", "match"), [
    ({"epoch": 1, "nodes": []}, "at least one node"),
    ({"epoch": 0, "nodes": [{"id": "a", "data": "h:1"}]}, "epoch"),
    ({"epoch": 0, "fallbacks": 0, "nodes": [{"id": "a", "data": "h:1"},
                                            {"id": "b", "data": "h:2"}]}, "standalone"),
    ({"epoch": -1, "nodes": [{"id": "a", "data": "h:1"}]}, "epoch"),
    ({"epoch": 1, "replication": 0, "nodes": [{"id": "a", "data": "h:1"}]}, "replication"),
    ({"epoch": 1, "nodes": [{"id": "a", "data": "h:1"}, {"id": "a", "data": "h:2"}]}, "unique"),
    ({"epoch": 1, "nodes": [{"id": "a", "data": "h:1"}, {"id": "b", "data": "h:1"}]}, "unique"),
    ({"epoch": 1, "nodes": [{"id": "a", "data": "nohost"}]}, "host:port"),
    ({"epoch": 1, "nodes": [{"id": "a", "data": "h:1", "weight": 0}]}, "weight"),
    ({"epoch": 1, "nodes": [{"id": "a", "data": "h:1", "state": "gone"}]}, "state"),
    ({"epoch": 1, "nodes": [{"id": "a", "data": "h:1", "state": "down"}]}, "'up'"),
    ({"epoch": 1, "nodes": [{"id": "a", "data": "h:1", "colour": "red"}]}, "unknown node"),
    ({"epoch": 1, "nodez": []}, "unknown cluster map"),
    ({"epoch": 1, "nodes": [{"id": "a", "data": "h:1", "rack": 3}]}, "rack must be"),
    ({"epoch": 1, "nodes": [{"id": "a", "data": "h:1", "zone": "z\n"}]}, "zone must be"),
    ({"epoch": 1, "nodes": [{"id": "a", "data": "h:1", "host": "x" * 129}]}, "host must be"),
    ({"epoch": 1, "nodes": [{"id": "a", "data": "h:1", "host": "m", "rack": "1"},
                            {"id": "b", "data": "h:2", "host": "m", "rack": "2"}]},
     "host 'm' is in two places"),
    ({"epoch": 1, "nodes": [{"id": "a", "data": "h:1", "zone": "x"},
                            {"id": "b", "data": "h:2"}]}, "host 'h' is in two places"),
])
def test_bad_maps_are_refused_with_clear_errors(data: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ClusterMap.from_dict(data)


def test_a_standalone_nodes_map_is_epoch_0_and_only_that(tmp_path: Path) -> None:
    """Epoch 0 is a standalone node's own map (clients route by it like any map); a
    cluster file cannot claim it."""
    own = ClusterMap.standalone("solo", "127.0.0.1:7700")
    assert own.is_standalone and own.epoch == 0
    assert own.preference([os.urandom(16)]) == [["solo"]]
    assert ClusterMap.from_dict(own.to_dict()) == own  # as the node's CLUSTER op serves it
    assert not ClusterMap.from_peers("127.0.0.1:7700").is_standalone
    path = tmp_path / "cluster.toml"
    path.write_text(own.to_toml())
    with pytest.raises(ConfigError, match="epoch must be >= 1"):
        ClusterMap.from_toml(path)
