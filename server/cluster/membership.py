"""A node's view of the cluster: the current map, which entry is this node, and its source.

A node runs standalone (no map: epoch 0, it owns every key) or with a map
from one of two sources behind :class:`MapSource`:

- :class:`StaticSource`: a TOML file (``--cluster-file``) or ``--peers``;
  the node reads it again on SIGHUP. The epoch is the file's.
- ``etcd`` (:mod:`kvpool.server.cluster.etcd`): the map lives in etcd; the epoch is
  etcd's revision.

The data path asks :meth:`Membership.accepts` only for requests routed with
an older epoch than the node's, so a steady-state cluster pays nothing.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from kvpool.placement.cluster_map import ClusterMap, NodeInfo
from kvpool.protocol.errors import ConfigError

__all__ = ["MapSource", "Membership", "StaticMapError", "StaticSource", "check_labels"]

log = logging.getLogger("kvpool.server")


class StaticMapError(ConfigError):
    """A change asked of a map that only its file (or flags) can change."""


def check_labels(entry: NodeInfo, labels: Mapping[str, str], source: str) -> None:
    """Refuse to start a node whose own ``--host-id``/``--rack``/``--zone`` disagree
    with its entry in a static map: clients place keys by the map's labels."""
    placed = dict(zip(("zone", "rack", "host"), entry.domain, strict=True))
    for label, value in labels.items():
        if placed[label] != value:
            flag = "--host-id" if label == "host" else f"--{label}"
            raise ConfigError(
                f"{flag} {value!r}, but the cluster map ({source}) puts node {entry.id!r} in "
                f"{label} {placed[label]!r}; clients place keys by the map: set {label} in "
                "its entry (or leave the flag out)")


class MapSource(Protocol):
    """Where the map comes from.

    ``start`` returns the first map once this node is known by its entry
    (``me``: id, advertised data and admin addresses) and may keep feeding
    later maps to ``install``; ``reload`` (SIGHUP) reads the source again;
    ``change`` applies an admin request (join, drain, remove).
    """

    async def start(self, me: NodeInfo, install: Callable[[ClusterMap], object]) -> ClusterMap:
        ...

    async def stop(self) -> None: ...

    def reload(self) -> ClusterMap | None: ...

    async def change(self, action: str, node_id: str,
                     fields: dict[str, Any] | None = None) -> ClusterMap: ...

    def describe(self) -> str: ...


class StaticSource:
    """A fixed map from a TOML file (re-read on SIGHUP) or a ``--peers`` list."""

    def __init__(self, *, file: str = "", peers: str = "", replication: int = 1) -> None:
        if bool(file) == bool(peers):
            raise ConfigError("a static cluster needs exactly one of --cluster-file or --peers")
        self.file = file
        self.peers = peers
        self.replication = replication

    def load(self) -> ClusterMap:
        if self.file:
            return ClusterMap.from_toml(Path(self.file))
        return ClusterMap.from_peers(self.peers, replication=self.replication)

    async def start(self, me: NodeInfo, install: Callable[[ClusterMap], object]) -> ClusterMap:
        return self.load()

    async def stop(self) -> None:
        return None

    def reload(self) -> ClusterMap | None:
        return self.load()

    async def change(self, action: str, node_id: str,
                     fields: dict[str, Any] | None = None) -> ClusterMap:
        raise StaticMapError(f"this node's cluster map is {self.describe()}: edit it and send "
                          "SIGHUP to every node (join/drain/remove need the etcd source)")

    def describe(self) -> str:
        return f"static file {self.file}" if self.file else f"static peers {self.peers}"


class Membership:
    """The node's current map and its own id in it."""

    def __init__(self, source: MapSource | None = None) -> None:
        self.source = source
        self.map: ClusterMap | None = None
        self.node_id = ""
        self.listeners: list[Callable[[ClusterMap], None]] = []
        #: this node's failure domains as its flags set them (host, rack, zone; unset
        #: ones left out): a static map must agree, at start and at each reload
        self.labels: dict[str, str] = {}

    async def start(self, node_id: str, data: tuple[str, int], admin: tuple[str, int],
                    labels: Mapping[str, str] | None = None) -> None:
        """Load the first map and find this node in it (``data``/``admin``: advertised;
        ``labels``: the failure domains set on this node, ``host``, ``rack``, ``zone``)."""
        labels = {k: v for k, v in (labels or {}).items() if v}
        self.labels = labels
        if self.source is None:
            self.resolve_self(node_id, data)
            return
        me = NodeInfo(id=node_id or f"{data[0]}:{data[1]}", data=f"{data[0]}:{data[1]}",
                      admin=f"{admin[0]}:{admin[1]}",
                      host=labels.get("host", socket.gethostname()),
                      rack=labels.get("rack", ""), zone=labels.get("zone", ""))
        self.map = await self.source.start(me, self.install)
        self.resolve_self(node_id if node_id or me.id not in self.map.by_id else me.id, data)
        if isinstance(self.source, StaticSource):
            check_labels(self.map.by_id[self.node_id], labels, self.source.describe())

    async def stop(self) -> None:
        if self.source is not None:
            await self.source.stop()

    @property
    def epoch(self) -> int:
        return self.map.epoch if self.map is not None else 0

    def resolve_self(self, node_id: str, data_address: tuple[str, int]) -> str:
        """Find this node's entry: by ``node_id`` if set, else by its data address
        (or by its port alone, if only one entry has that port)."""
        cmap = self.map
        if cmap is None:
            self.node_id = node_id or f"{data_address[0]}:{data_address[1]}"
            return self.node_id
        if node_id:
            if node_id not in cmap.by_id:
                raise ConfigError(f"--node-id {node_id!r} is not in the cluster map "
                                  f"(ids: {sorted(cmap.by_id)})")
            self.node_id = node_id
            return node_id
        host, port = data_address
        matches = [n for n in cmap.nodes if n.data_address == (host, port)] or \
            [n for n in cmap.nodes if n.data_address[1] == port]
        if len(matches) != 1:
            raise ConfigError(
                f"cannot tell which cluster-map entry is this node (data address {host}:{port}"
                f" matches {len(matches)}); set --node-id")
        self.node_id = matches[0].id
        return self.node_id

    def accepts(self, keys: Sequence[bytes]) -> bool:
        """True if this node takes reads and writes of every key under the current map."""
        cmap = self.map
        return cmap is None or not keys or cmap.accepts(self.node_id, keys)

    def reload(self) -> bool:
        """Read the source again; True if the map changed."""
        if self.source is None:
            return False
        try:
            new = self.source.reload()
            me = new.by_id.get(self.node_id) if new is not None else None
            if me is not None and isinstance(self.source, StaticSource):
                check_labels(me, self.labels, self.source.describe())  # as at start
        except ConfigError as exc:
            log.error("cluster map reload from %s failed; keeping epoch %d: %s",
                      self.source.describe(), self.epoch, exc)
            return False
        return new is not None and self.install(new)

    def install(self, new: ClusterMap) -> bool:
        old = self.map
        if old is not None and new == old:
            return False
        if self.node_id and self.node_id not in new.by_id:
            log.warning("cluster map epoch %d no longer lists this node (%s)", new.epoch,
                        self.node_id)
        if old is not None and new.epoch < old.epoch:
            log.warning("cluster map epoch went back from %d to %d", old.epoch, new.epoch)
        self.map = new
        log.info("cluster map epoch %d: %d nodes, replication %d", new.epoch, len(new.nodes),
                 new.replication)
        for listener in self.listeners:
            listener(new)
        return True

    def me(self) -> NodeInfo | None:
        return self.map.by_id.get(self.node_id) if self.map is not None else None

    async def change(self, action: str, node_id: str,
                     fields: dict[str, Any] | None = None) -> ClusterMap:
        """An admin change (join, drain, remove) through the source."""
        if self.source is None:
            raise StaticMapError("this node runs standalone: there is no cluster to change")
        return await self.source.change(action, node_id, fields)

    def to_dict(self, data_address: tuple[str, int], admin_address: tuple[str, int]
                ) -> dict[str, Any]:
        """The map as served by ``GET /v1/cluster`` and the CLUSTER op."""
        if self.map is not None:
            return {**self.map.to_dict(), "node_id": self.node_id,
                    "source": self.source.describe() if self.source else ""}
        me = {"id": self.node_id, "data": f"{data_address[0]}:{data_address[1]}",
              "admin": f"{admin_address[0]}:{admin_address[1]}", "weight": 1.0, "state": "up"}
        return {"epoch": 0, "replication": 1, "fallbacks": 0, "nodes": [me],
                "node_id": self.node_id, "source": "standalone"}
