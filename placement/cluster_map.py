"""The cluster map: who is in the cluster, and so who owns which key. Pure.

A map is an epoch, a replication factor and a list of nodes (id, data
address, admin address, weight, state). Epoch 0 is a standalone node's own
map (:meth:`ClusterMap.standalone`: that node alone, no replication): clients
route to a standalone node by it like to any cluster. Nodes and clients that hold maps
of the same epoch place every key the same way. Where a map comes from
(a static file, etcd) is the server's business; this module only parses,
validates, serialises and places.

Placement: the ring holds the nodes that are ``up`` (``draining`` and
``down`` nodes own nothing), each in its failure domains (zone, rack, host:
the node's labels; a node without a host label is on the host of its data
address), and spreads a key's places over them (``placement/ring.py``). The
*owners* of a key are the first ``replication`` nodes of its preference list;
the next ``fallbacks`` nodes take writes while an owner is unreachable. A node accepts a key that is
anywhere in those first ``replication + fallbacks`` places.
"""

from __future__ import annotations

import enum
import json
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from kvpool.placement.ring import DEFAULT_VNODES_PER_WEIGHT, Domain, Ring, key_positions
from kvpool.protocol.errors import ConfigError

__all__ = ["MAX_COPIES", "MAX_RING_POINTS", "MAX_WEIGHT", "STANDALONE_EPOCH", "ClusterMap",
           "NodeInfo", "NodeState", "parse_address"]

#: the largest node weight (weights are relative capacities: 100 is a node a hundred
#: times the size of a node of weight 1)
MAX_WEIGHT = 100.0
#: the most ring points a map may make (2048 a unit of weight): 2,048 nodes of weight 1,
#: ~80 MB of ring at width 3. What bounds the memory a map read from a peer can take.
MAX_RING_POINTS = 1 << 22
#: the most copies (replication) and fallbacks a map may ask for
MAX_COPIES = 16
#: the longest failure-domain label (host, rack, zone)
MAX_LABEL = 128
_LABELS = ("host", "rack", "zone")


class NodeState(enum.StrEnum):
    UP = "up"
    DRAINING = "draining"
    DOWN = "down"


def parse_address(text: str, what: str = "address") -> tuple[str, int]:
    """``host:port`` -> (host, port), with a clear error."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} must be host:port, got {text!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class NodeInfo:
    id: str
    data: str  #: host:port of the binary data port, as clients reach it
    admin: str = ""  #: host:port of the admin HTTP port ("" if unknown)
    weight: float = 1.0
    state: NodeState = NodeState.UP
    #: failure domains: the machine (default: the data address's host), its rack, its zone
    host: str = ""
    rack: str = ""
    zone: str = ""

    def __post_init__(self) -> None:
        if not self.id or not isinstance(self.id, str):
            raise ConfigError("every node needs a non-empty string id")
        parse_address(self.data, f"node {self.id!r} data address")
        if self.admin:
            parse_address(self.admin, f"node {self.id!r} admin address")
        if isinstance(self.weight, bool) or not isinstance(self.weight, int | float) \
                or not 0 < self.weight <= MAX_WEIGHT:
            raise ConfigError(f"node {self.id!r}: weight must be in (0, {MAX_WEIGHT:g}], got "
                              f"{self.weight!r}")
        for label in _LABELS:
            value = getattr(self, label)
            if not isinstance(value, str) or len(value) > MAX_LABEL \
                    or not value.isprintable():
                raise ConfigError(f"node {self.id!r}: {label} must be a printable string of at"
                                  f" most {MAX_LABEL} characters, got "
                                  f"{repr(value)[:MAX_LABEL + 2]}")  # (a map from a peer)
        try:
            object.__setattr__(self, "state", NodeState(self.state))
        except ValueError:
            raise ConfigError(f"node {self.id!r}: state must be one of "
                              f"{[s.value for s in NodeState]}, got {self.state!r}") from None

    @property
    def data_address(self) -> tuple[str, int]:
        return parse_address(self.data)

    @property
    def domain(self) -> Domain:
        """(zone, rack, host) as placement sees them: no host label = the data address's."""
        return (self.zone, self.rack, self.host or self.data_address[0])

    def to_dict(self) -> dict[str, Any]:
        # labels only when set: a map without them reads as it did before they existed
        return {"id": self.id, "data": self.data, "admin": self.admin, "weight": self.weight,
                "state": self.state.value,
                **{label: getattr(self, label) for label in _LABELS if getattr(self, label)}}


#: the epoch of a standalone node's own map (a cluster's maps start at 1)
STANDALONE_EPOCH = 0
_NODE_FIELDS = {"id", "data", "admin", "weight", "state", *_LABELS}
_MAP_FIELDS = {"epoch", "replication", "fallbacks", "nodes"}


@dataclass(frozen=True)
class ClusterMap:
    epoch: int
    nodes: tuple[NodeInfo, ...]
    replication: int = 1
    fallbacks: int = 1
    by_id: Mapping[str, NodeInfo] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.epoch, int) or self.epoch < 0:
            raise ConfigError(f"cluster epoch must be an integer >= 1, got {self.epoch!r}")
        if self.epoch == STANDALONE_EPOCH and not (
                len(self.nodes) == 1 and self.replication == 1 and self.fallbacks == 0):
            raise ConfigError("cluster epoch must be an integer >= 1, got 0 (epoch 0 is a "
                              "standalone node's own map: one node, replication 1, no "
                              "fallbacks)")
        if not isinstance(self.replication, int) or not 1 <= self.replication <= MAX_COPIES:
            raise ConfigError(f"replication must be an integer in [1, {MAX_COPIES}], got "
                              f"{self.replication!r}")
        if not isinstance(self.fallbacks, int) or not 0 <= self.fallbacks <= MAX_COPIES:
            raise ConfigError(f"fallbacks must be an integer in [0, {MAX_COPIES}], got "
                              f"{self.fallbacks!r}")
        if not self.nodes:
            raise ConfigError("a cluster map needs at least one node")
        ids = [n.id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"node ids must be unique, got {ids}")
        datas = [n.data for n in self.nodes]
        if len(set(datas)) != len(datas):
            raise ConfigError(f"node data addresses must be unique, got {datas}")
        if not any(n.state == NodeState.UP for n in self.nodes):
            raise ConfigError("a cluster map needs at least one node in state 'up'")
        points = sum(max(1, round(n.weight * DEFAULT_VNODES_PER_WEIGHT)) for n in self.nodes
                     if n.state == NodeState.UP)
        if points > MAX_RING_POINTS:
            raise ConfigError(f"the ring of this map would have {points} points, over "
                              f"{MAX_RING_POINTS} (lower the weights: only their ratios count)")
        racks: dict[str, tuple[str, str]] = {}
        for n in self.nodes:
            zone, rack, host = n.domain
            if racks.setdefault(host, (zone, rack)) != (zone, rack):
                raise ConfigError(
                    f"host {host!r} is in two places: zone {racks[host][0]!r} rack "
                    f"{racks[host][1]!r}, and zone {zone!r} rack {rack!r} (node {n.id!r}); "
                    "every node of one host needs the same rack and zone")
        object.__setattr__(self, "by_id", {n.id: n for n in self.nodes})

    @classmethod
    def standalone(cls, node_id: str, data: str, admin: str = "") -> ClusterMap:
        """A standalone node's map: that node alone, epoch 0, no replication."""
        return cls(epoch=STANDALONE_EPOCH, nodes=(NodeInfo(id=node_id, data=data, admin=admin),),
                   replication=1, fallbacks=0)

    @property
    def is_standalone(self) -> bool:
        """Whether this is a standalone node's own map (epoch 0), not a cluster's."""
        return self.epoch == STANDALONE_EPOCH

    # -- placement ------------------------------------------------------------------------

    @property
    def width(self) -> int:
        """How many places of a key's preference list take its reads and writes."""
        return min(self.replication + self.fallbacks, len(self.ring))

    @property
    def num_owners(self) -> int:
        return min(self.replication, len(self.ring))

    @cached_property
    def ring(self) -> Ring:
        up = [n for n in self.nodes if n.state == NodeState.UP]
        return Ring({n.id: n.weight for n in up}, width=self.replication + self.fallbacks,
                    domains={n.id: n.domain for n in up})

    def preference(self, keys: bytes | Sequence[bytes]) -> list[list[str]]:
        """For each key, its owners then its fallbacks (``width`` node ids)."""
        return self.ring.owners_many(keys, self.width)

    def accepts(self, node_id: str, keys: bytes | Sequence[bytes]) -> bool:
        """True if ``node_id`` is among the first ``width`` places of every key."""
        ring = self.ring
        if node_id not in ring.weights:
            return False
        if len(ring) <= self.width:
            return True
        index = ring.nodes.index(node_id)
        table = ring.owner_indexes(key_positions(keys), self.width)
        return bool((table == index).any(axis=1).all())

    # -- (de)serialisation ----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "replication": self.replication,
                "fallbacks": self.fallbacks, "nodes": [n.to_dict() for n in self.nodes]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, epoch: int | None = None) -> ClusterMap:
        if not isinstance(data, Mapping):
            raise ConfigError("a cluster map must be a table/object")
        unknown = set(data) - _MAP_FIELDS
        if unknown:
            raise ConfigError(f"unknown cluster map field(s) {sorted(unknown)}; "
                              f"known: {sorted(_MAP_FIELDS)}")
        raw_nodes = data.get("nodes")
        if not isinstance(raw_nodes, list):
            raise ConfigError("a cluster map needs a list of nodes ([[nodes]] in TOML)")
        nodes = []
        for raw in raw_nodes:
            if not isinstance(raw, Mapping):
                raise ConfigError("each node must be a table/object")
            bad = set(raw) - _NODE_FIELDS
            if bad:
                raise ConfigError(f"unknown node field(s) {sorted(bad)}; known: "
                                  f"{sorted(_NODE_FIELDS)}")
            if "id" not in raw or "data" not in raw:
                raise ConfigError(f"every node needs 'id' and 'data', got {dict(raw)}")
            nodes.append(NodeInfo(**raw))
        return cls(epoch=data.get("epoch", 1) if epoch is None else epoch, nodes=tuple(nodes),
                   replication=data.get("replication", 1), fallbacks=data.get("fallbacks", 1))

    @classmethod
    def from_toml(cls, path: str | Path) -> ClusterMap:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read cluster file {path}: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"cluster file {path} is not valid TOML: {exc}") from exc
        if data.get("epoch") == STANDALONE_EPOCH:
            raise ConfigError(f"cluster file {path}: epoch must be >= 1 (0 is a standalone "
                              "node's own map)")
        return cls.from_dict(data)

    @classmethod
    def from_peers(cls, peers: str, *, epoch: int = 1, replication: int = 1,
                   fallbacks: int = 1) -> ClusterMap:
        """``host:port,host:port,...`` (data ports): ids are the addresses, admin = port+1."""
        nodes = []
        for part in filter(None, (p.strip() for p in peers.split(","))):
            host, port = parse_address(part, "each --peers entry")
            nodes.append(NodeInfo(id=part, data=part, admin=f"{host}:{port + 1}"))
        return cls(epoch=epoch, nodes=tuple(nodes), replication=replication,
                   fallbacks=fallbacks)

    def to_toml(self) -> str:
        lines = [f"epoch = {self.epoch}", f"replication = {self.replication}",
                 f"fallbacks = {self.fallbacks}"]
        for n in self.nodes:
            lines += ["", "[[nodes]]", f'id = "{n.id}"', f'data = "{n.data}"',
                      f'admin = "{n.admin}"', f"weight = {n.weight}", f'state = "{n.state}"',
                      *(f"{label} = {json.dumps(getattr(n, label))}" for label in _LABELS
                        if getattr(n, label))]
        return "\n".join(lines) + "\n"

    def with_epoch(self, epoch: int) -> ClusterMap:
        return replace(self, epoch=epoch)

    def node_for_address(self, host: str, port: int) -> NodeInfo | None:
        for n in self.nodes:
            if n.data_address == (host, port):
                return n
        return None

