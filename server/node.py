"""A kvpool node: the data port, the admin port and the tiers, on one event loop (the
process around it: ``run.py``; what it takes from the machine: ``resources.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import sys
from collections.abc import Callable
from typing import Any

from aiohttp import web
from opentelemetry.trace import Tracer

from kvpool.placement.cluster_map import ClusterMap, NodeState
from kvpool.protocol.errors import ConfigError
from kvpool.protocol.parsers import Limits
from kvpool.server.admin.api import make_admin_app
from kvpool.server.admin.events import EventBus
from kvpool.server.admin.metrics import MetricsFeed, NodeMetrics
from kvpool.server.admin.site import CappedSite, reserve_descriptors
from kvpool.server.admin.tracing import NodeTracing, tracing_configured
from kvpool.server.cluster.etcd import EtcdSource
from kvpool.server.cluster.handoff import Handoff
from kvpool.server.cluster.lookup import ClusterLookup
from kvpool.server.cluster.membership import MapSource, Membership, StaticSource
from kvpool.server.cold.base import ColdTier, NoColdTier
from kvpool.server.cold.tiering import TierManager
from kvpool.server.config import ClusterConfig, NodeConfig, ServerConfig
from kvpool.server.data.connection import NodeConnection, close_all
from kvpool.server.data.handlers import Handlers
from kvpool.server.data.shm import ShmService
from kvpool.server.data.snapshot import node_snapshot
from kvpool.server.data.stats import NodeStats
from kvpool.server.resources import (
    advertised,
    bind_error,
    bound_socket,
    dram_tier,
    start_cold,
    tiering_policy,
)
from kvpool.server.security.auth import TokenTable, load_tokens
from kvpool.server.security.hardening import forbid_dumps
from kvpool.server.security.tls import client_context, server_context
from kvpool.tiers.dram import DramTier

__all__ = ["Node"]

log = logging.getLogger("kvpool.server")

#: seconds between metric snapshots for the OTLP exporter (scrapes take a fresh one)
METRICS_REFRESH_S = 5.0


def map_source(cluster: ClusterConfig) -> MapSource | None:
    """Where the node's cluster map comes from: etcd, a file or a peer list, or nowhere
    (a standalone node)."""
    if cluster.etcd:
        return EtcdSource(cluster.etcd, prefix=cluster.etcd_prefix,
                          lease_ttl_s=cluster.lease_ttl_s, auto_join=cluster.auto_join,
                          replication=cluster.replication, user=cluster.etcd_user,
                          password=cluster.etcd_password)
    if cluster.file or cluster.peers:
        return StaticSource(file=cluster.file, peers=cluster.peers,
                            replication=cluster.replication)
    return None


async def bind_ports(server: ServerConfig, accept: Callable[[], asyncio.BaseProtocol],
                     tls: ssl.SSLContext | None) -> tuple[asyncio.Server, socket.socket]:
    """The data port's server (``accept`` makes its connections; not serving yet) and the
    admin port's bound socket; ConfigError naming the flag when a port is taken."""
    try:
        data = await asyncio.get_running_loop().create_server(
            accept, server.host, server.data_port, reuse_address=True, start_serving=False,
            ssl=tls, ssl_handshake_timeout=server.hello_timeout_s if tls else None)
    except OSError as exc:
        raise ConfigError(bind_error(exc, server.host, server.data_port, "--data-port",
                                      "KVPOOL_DATA_PORT")) from None
    family = socket.AF_INET6 if ":" in server.host else socket.AF_INET
    try:
        admin = bound_socket(server.host, server.admin_port, family)
    except OSError as exc:
        data.close()
        raise ConfigError(bind_error(exc, server.host, server.admin_port, "--admin-port",
                                      "KVPOOL_ADMIN_PORT")) from None
    return data, admin


class Node:
    """Owns the tiers and the listening sockets. ``start``/``stop`` on a running loop."""

    def __init__(self, config: NodeConfig, *, dram: DramTier | None = None) -> None:
        self.config = config
        server = config.server
        self.dram = dram if dram is not None else dram_tier(config)
        self.stats = NodeStats(timed=config.server.metrics)
        self.limits = Limits(server.max_frame_bytes, server.max_batch, server.max_value_bytes)
        self.membership = Membership(map_source(config.cluster))
        #: what happens to chunks on this node (``/v1/events``)
        self.events = EventBus(server.node_id)
        #: DRAM and the cold tier as one store, made by ``start`` once the cold tier runs
        self._tiers: TierManager | None = None
        #: what lies below DRAM (started by ``start``: the SSD worker's handle, or nothing)
        self.cold: ColdTier = NoColdTier()
        security = config.security
        #: tokens -> tenant and role (empty: open mode); replaced whole on SIGHUP
        self.auth = load_tokens(security.auth_tokens) if security.auth_tokens else TokenTable()
        #: the node's spans (None: tracing is not configured; set as it starts)
        self.tracing: NodeTracing | None = None
        #: the op table, made by ``start`` once everything it is given is known
        self._handlers: Handlers | None = None
        self.tls = server_context(security)
        #: how this node connects to its peers: token, scope and TLS
        self.peer_options: dict[str, Any] = {"token": security.peer_token, "scope": "raw",
                                             "ssl": client_context(security)}
        self.connections: set[NodeConnection] = set()
        #: the admin API's lookups (the cluster's, or this node's tiers when standalone)
        self.lookup = ClusterLookup(self.membership,
                                    lambda keys: self.tiers.tiers(keys),  # noqa: PLW0108 (made by start)
                                    lambda: self.data_address, self.peer_options)
        self.handoff: Handoff | None = None
        self._server: asyncio.Server | None = None
        #: the flock on data_dir/LOCK, held while the node runs (an SSD tier in data_dir)
        self._dir_lock: int | None = None
        self._admin: web.AppRunner | None = None
        self.admin_site: CappedSite | None = None
        self._expiry_task: asyncio.Task[None] | None = None
        self._stopping = False
        #: the metrics and what keeps them current (None: metrics are off)
        self.metrics: MetricsFeed | None = None
        self.shm: ShmService | None = None
        self.data_address: tuple[str, int] = (server.host, server.data_port)
        self.admin_address: tuple[str, int] = (server.host, server.admin_port)

    @property
    def tiers(self) -> TierManager:
        """DRAM and the cold tier as one store (the node has started)."""
        if self._tiers is None:
            raise RuntimeError("the node has not started")
        return self._tiers

    @property
    def handlers(self) -> Handlers:
        """The op table (the node has started)."""
        if self._handlers is None:
            raise RuntimeError("the node has not started")
        return self._handlers

    def _tracer(self) -> Tracer | None:
        """The tracer of the spans tiers make (None: tracing is not configured)."""
        return self.tracing.tracer if self.tracing is not None else None

    async def _start_tiers(self) -> None:
        """The cold tier (its worker process, with the SSD tier, S3, or both; none: a
        DRAM-only node, as the tiering policy says), then the tier manager over it."""
        policy = tiering_policy(self.config)
        if policy.cold:
            self.cold, self._dir_lock = await start_cold(self.config, self.dram, policy)
        self._tiers = TierManager(self.dram, self.cold, self.events, policy=policy,
                                  tracer=self._tracer)

    async def start(self) -> None:
        if self.config.security.auth_tokens and forbid_dumps():
            # tenants: no process of this user may reach the arena through /proc or ptrace
            log.info("tenants configured: this node is non-dumpable")
        # bind both ports first (port 0 picks one), join the cluster under the addresses
        # they got, and only then serve: no client sees a node that has no map yet. Bound
        # before the SSD tier starts, so a port in use fails at once, in one line.
        self._server, admin_sock = await bind_ports(self.config.server, self._accept, self.tls)
        self.data_address = self._server.sockets[0].getsockname()[:2]
        self.admin_address = admin_sock.getsockname()[:2]
        try:
            await self._start_tiers()
        except BaseException:
            self._server.close()
            admin_sock.close()
            if self._dir_lock is not None:
                os.close(self._dir_lock)
                self._dir_lock = None
            raise
        self._apply_quotas()
        try:
            server = self.config.server
            data, admin = (advertised(a, server.advertise_host)
                           for a in (self.data_address, self.admin_address))
            await self.membership.start(server.node_id, data, admin,
                                        {"host": server.host_id, "rack": server.rack,
                                         "zone": server.zone})
        except BaseException:
            self._server.close()
            admin_sock.close()
            raise
        self.events.node_id = self.membership.node_id
        extra_stats = await self._start_services()
        self._handlers = Handlers(
            self.membership.node_id, self.tiers, self.limits, self.stats, self.membership,
            auth=self.auth, idle_timeout_s=self.config.server.idle_timeout_s,
            addresses=(self.data_address, self.admin_address), shm=self.shm,
            tracing=self.tracing, extra_stats=extra_stats)
        if self.metrics is not None:
            self.metrics.start()
        server = self.config.server
        reserve_descriptors(server.max_connections, server.admin_max_connections)
        # keepalive_timeout: aiohttp's timer runs from accept, so a connection that never
        # sends a request is closed after it too
        self._admin = web.AppRunner(make_admin_app(self), access_log=None,
                                    keepalive_timeout=server.admin_idle_timeout_s)
        await self._admin.setup()
        self.admin_site = CappedSite(self._admin, admin_sock,
                                     max_connections=server.admin_max_connections,
                                     ssl_context=self.tls)
        await self.admin_site.start()
        await self._server.start_serving()
        self._expiry_task = asyncio.create_task(self._expire_loop())

    async def _start_services(self) -> dict[str, Callable[[], Any]]:
        """What runs beside the data path once the node has its id and map: hand-off
        (drain), metrics, the shared-memory service, tracing; the stats sections they
        add."""
        host, port = advertised(self.data_address, self.config.server.advertise_host)
        self.handoff = Handoff(self.dram, f"kvpool://{host}:{port}",
                               rate_bytes_s=self.config.cluster.drain_rate_bytes,
                               leave=lambda: self.membership.change("remove",
                                                                    self.membership.node_id),
                               client_options=self.peer_options)
        extra_stats: dict[str, Callable[[], Any]] = {"drain": self.handoff_progress}
        self.membership.listeners.append(self._map_changed)
        self._map_changed(self.membership.map)
        if self.config.server.metrics:
            self.metrics = MetricsFeed(NodeMetrics(self.membership.node_id),
                                       self.snapshot, self.stats,
                                       self._node_states, interval_s=METRICS_REFRESH_S)
        if self.config.server.shm and sys.platform.startswith("linux"):
            self.shm = ShmService(self.dram, lease_s=self.config.server.shm_lease_s,
                                  allow=self.config.server.shm_allow,
                                  write=self.config.server.shm_write)
            await self.shm.start()
            self._publish_epoch()
            extra_stats["shm"] = self.shm.stats
        if tracing_configured():
            self.tracing = NodeTracing(self.membership.node_id)
        return extra_stats

    def _accept(self) -> NodeConnection:
        server = self.config.server
        return NodeConnection(self.handlers, self.connections,
                              max_connections=server.max_connections,
                              idle_timeout_s=server.idle_timeout_s,
                              hello_timeout_s=server.hello_timeout_s)

    def _apply_quotas(self) -> None:
        self.tiers.set_quotas(self.auth.quotas)

    def reload(self) -> None:
        """SIGHUP: re-read the cluster map and the tokens file (a bad file keeps the old)."""
        self.membership.reload()
        path = self.config.security.auth_tokens
        if not path:
            return
        try:
            table = load_tokens(path)
        except ConfigError as exc:
            log.error("tokens file not reloaded, the previous one stays in force: %s", exc)
            return
        self.auth = table
        if self._handlers is not None:
            self._handlers.auth = table
        self._apply_quotas()
        closed = sum(conn.recheck(table) for conn in list(self.connections))
        streams = self.events.recheck(table)
        log.info("tokens reloaded from %s: %d tokens, %d tenant quotas; %d connections "
                 "and %d event streams closed (token revoked or changed)", path,
                 len(table.entries), len(self.dram.tenants.quotas), closed, streams)

    # -- what the admin API asks of the node ----------------------------------------------

    @property
    def admin_token(self) -> str:
        return self.config.server.admin_token

    def tenant_usage(self) -> dict[str, dict[str, int]]:
        return self.tiers.tenant_usage()

    def ready(self) -> tuple[bool, str]:
        """Whether clients should be sent here (GET /readyz)."""
        if self._stopping:
            return False, "stopping"
        if (self.cold.has_ssd or self.cold.has_s3) and not self.cold.up:
            return True, "ssd tier down: serving from DRAM only"
        me = self.membership.me()
        if self.membership.map is not None and me is None:
            return False, "not in the cluster map"
        if me is not None and me.state != NodeState.UP:
            return False, f"cluster state {me.state.value}"
        return True, "ok"

    def chunk_info(self, key: bytes) -> dict[str, Any] | None:
        return self.tiers.chunk_info(key)

    def delete_chunk(self, key: bytes) -> bool:
        return self.tiers.delete([key])[0]

    def pin_chunk(self, key: bytes, pinned: bool) -> bool:
        return self.dram.pin_many([key], pinned)[0]

    def evict(self, tier: str | None, namespace: bytes | None) -> dict[str, int]:
        return self.tiers.evict(tier, namespace)

    async def flush(self, timeout_s: float) -> dict[str, Any]:
        return await self.tiers.flush(timeout_s)

    async def metrics_text(self) -> bytes | None:
        """The Prometheus exposition for GET /metrics (None when metrics are off)."""
        return await self.metrics.text() if self.metrics is not None else None

    def _node_states(self) -> list[str]:
        cmap = self.membership.map
        return [n.state.value for n in cmap.nodes] if cmap is not None else ["up"]

    def _publish_epoch(self) -> None:
        if self.shm is not None and self.shm.index is not None:
            self.shm.index.set_epoch(self.membership.epoch)

    def _map_changed(self, cmap: ClusterMap | None) -> None:
        self._publish_epoch()
        me = cmap.by_id.get(self.membership.node_id) if cmap is not None else None
        if me is not None and me.state == NodeState.DRAINING and self.handoff is not None \
                and self.handoff.progress.state in ("idle", "failed"):
            self.handoff.start()

    def handoff_progress(self) -> dict[str, object]:
        return self.handoff.progress.to_dict() if self.handoff is not None else {}

    @property
    def node_id(self) -> str:
        return self.membership.node_id or self.config.server.node_id

    async def snapshot(self) -> dict[str, Any]:
        return await node_snapshot(self.handlers)

    async def change(self, action: str, node_id: str, fields: dict[str, Any]) -> ClusterMap:
        return await self.membership.change(action, node_id, fields)

    def cluster_info(self) -> dict[str, Any]:
        return self.membership.to_dict(self.data_address, self.admin_address)

    async def _expire_loop(self) -> None:
        interval = self.config.server.expire_interval_s
        if self.shm is not None:  # fast-path leases end within a quarter of their length late
            interval = min(interval, self.shm.lease_s / 4)
        while True:
            await asyncio.sleep(interval)
            if self.shm is not None:
                self.shm.expire()
            self.dram.expire()

    async def stop(self) -> None:
        """Stop accepting, let open connections flush their replies, then close."""
        self._stopping = True
        if self.metrics is not None:
            await self.metrics.stop_refreshing()
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry_task
        if self._server is not None:
            self._server.close()
        await close_all(self.connections, self.config.server.shutdown_grace_s)
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        self.events.close()  # ends open /v1/events streams
        if self._admin is not None:
            await self._admin.cleanup()
        await self.lookup.close()
        if self.handoff is not None:
            await self.handoff.stop()
        await self.membership.stop()
        await self.cold.stop()
        if self._dir_lock is not None:  # the worker has exited: the data dir is free
            os.close(self._dir_lock)
            self._dir_lock = None
        if self.shm is not None:
            await self.shm.stop()
        if self.metrics is not None:
            await self.metrics.close(final=self._handlers is not None)
        if self.tracing is not None:  # exports the spans still queued
            await asyncio.to_thread(self.tracing.shutdown)
