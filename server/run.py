"""The node's process: ``kvpool serve`` runs :func:`run_node` until SIGINT/SIGTERM.

It makes the :class:`~kvpool.server.node.Node`, says in a few lines what it serves
(tiers, cluster, auth; the ``kvpool: ready`` line that scripts and tests wait for),
reloads on SIGHUP and stops gracefully.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal

from kvpool.protocol.errors import ConfigError
from kvpool.server.cold.ssd import SsdTier, SsdUnavailableError
from kvpool.server.config import NodeConfig, format_size, unknown_env_vars
from kvpool.server.node import Node

__all__ = ["run_node"]

log = logging.getLogger("kvpool.server")


async def _serve(config: NodeConfig) -> None:
    node = Node(config)
    try:
        await node.start()
    except SsdUnavailableError as exc:
        raise ConfigError(str(exc)) from exc
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, node.reload)
    data_host, data_port = node.data_address
    admin_host, admin_port = node.admin_address
    dram = node.dram.stats()
    how = "configured" if config.dram.capacity_bytes else \
        f"{config.dram.capacity_fraction:.0%} of available memory"
    print(f"kvpool node {node.node_id}: DRAM tier {format_size(dram.capacity_bytes)} "
          f"({how})", flush=True)
    ssd = node.cold
    if isinstance(ssd, SsdTier) and ssd.has_ssd:
        print(f"kvpool node {node.node_id}: SSD tier {format_size(ssd.capacity_bytes)}"
              f" in {ssd.path} ({config.ssd.codec}), {len(ssd.index)} chunks on disk",
              flush=True)
    if config.s3.bucket:
        where = config.s3.endpoint_url or "AWS"
        below = "" if config.ssd.enabled else ", right below DRAM (no SSD tier)"
        print(f"kvpool node {node.node_id}: S3 tier s3://{config.s3.bucket}/"
              f"{config.s3.prefix} at {where} ({config.s3.codec}){below}", flush=True)
    cmap = node.membership.map
    if cmap is not None:
        assert node.membership.source is not None
        print(f"kvpool node {node.node_id}: cluster epoch {cmap.epoch}, "
              f"{len(cmap.nodes)} nodes, replication {cmap.replication} "
              f"({node.membership.source.describe()}; SIGHUP reloads)", flush=True)
    auth = node.auth
    if auth.open:
        log.warning("OPEN MODE: no --auth-tokens file, so every client that can reach "
                    "%s:%d may read, write and delete every chunk. Give a tokens file for "
                    "tenants and roles.", data_host, data_port)
    else:
        print(f"kvpool node {node.node_id}: auth on, {len(auth.entries)} tokens "
              f"from {auth.source} (SIGHUP reloads)", flush=True)
        if config.cluster.etcd and not config.cluster.etcd_user:
            log.warning("etcd without auth: whoever reaches %s can rewrite the cluster map "
                        "(and so where clients send their data). Give --etcd-user and "
                        "--etcd-password-file, and enable auth in etcd "
                        "(docs/security.md).", config.cluster.etcd)
    scheme = "https" if node.tls else "http"
    print(f"kvpool: ready data={data_host}:{data_port} admin={scheme}://{admin_host}:{admin_port}",
          flush=True)
    await stop.wait()
    log.info("shutting down: %d open connections", len(node.connections))
    await node.stop()
    print("kvpool: stopped", flush=True)


def run_node(config: NodeConfig) -> None:
    """Run a node until SIGINT/SIGTERM (uvloop when available)."""
    faulthandler.enable()  # a crash in native code (RocksDB, uvloop) says where, not nothing
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in unknown_env_vars(os.environ):
        log.warning("%s is set but is not a kvpool setting (a typo?); see kvpool serve --help",
                    name)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows
        asyncio.run(_serve(config))
    else:
        uvloop.run(_serve(config))
