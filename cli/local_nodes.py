"""Node processes this command starts and watches: ``kvpool cluster up`` (N nodes on
127.0.0.1, a map of their own) and ``kvpool serve --nodes N`` (N nodes of one host, one
host label, sharing its memory and disk; a map of their own, or etcd's).

Why several nodes on one host: a node is one Python process on one event loop, so it
serves from about one core. N nodes serve from N cores; clients spread a batch over them
by the map as over any nodes, and the host label keeps two copies of a key off one host.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.protocol.errors import ConfigError
from kvpool.server.config import NodeConfig, format_size, load_config, parse_size
from kvpool.server.memory import memory_limit

if TYPE_CHECKING:
    from kvpool.cli.local_cluster import LocalCluster

__all__ = ["cluster_up", "serve_nodes"]

#: wildcard bind addresses: a map needs an address clients can reach instead
_WILDCARDS = ("", "0.0.0.0", "::")


def cluster_up(args: argparse.Namespace) -> int:
    from kvpool.cli.local_cluster import LocalCluster

    serve_args = list(args.serve_args)
    if args.dram_capacity:
        serve_args = ["--dram-capacity", args.dram_capacity, *serve_args]
    if not any(a.startswith(("--ssd-capacity", "--ssd-fraction")) for a in serve_args):
        # the nodes share one disk: together they take the half a single node would
        serve_args = ["--ssd-fraction", f"{0.5 / args.nodes:.4g}", *serve_args]
    _check_room(args.nodes, args.base_port, "--base-port (0: any free ports)",
                args.dram_capacity)
    cluster = LocalCluster(args.nodes, replication=args.replication, data_dir=args.data_dir,
                           base_port=args.base_port, serve_args=serve_args,
                           log_level=args.log_level, startup_timeout=args.startup_timeout)
    print(f"kvpool: starting {args.nodes} nodes (replication {args.replication}); their data "
          f"and cluster.toml go to {cluster.data_dir.resolve()}", flush=True)
    return _run(cluster, restart=args.restart)


def serve_nodes(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``kvpool serve --nodes N [flags]``: N nodes with the flags given (``argv``, less
    ``--nodes``), each with its own ports (data port + 2i, admin port + 2i), data dir
    (``<data-dir>/n<i>``), a 1/N share of the DRAM and SSD a single node would take, and the
    host label of this machine (``--host-id``, default its hostname)."""
    from kvpool.cli.local_cluster import LocalCluster

    n = args.nodes
    config = load_config(args)  # every knob checked once, here, before N processes start
    server, cluster = config.server, config.cluster
    if cluster.file or cluster.peers:
        raise ConfigError("--nodes starts N nodes with a map of their own (or joins --etcd): "
                          "a --cluster-file or --peers map would have to list each of them; "
                          "run one `kvpool serve` a node for that")
    if server.data_port == 0 or server.admin_port == 0:
        raise ConfigError("--nodes needs fixed ports (node i: data port + 2i, admin port + 2i)")
    if server.admin_port != server.data_port + 1:
        raise ConfigError("--nodes gives node i data port P + 2i and admin port P + 2i + 1: "
                          f"set --admin-port to --data-port + 1 ({server.data_port + 1})")
    _check_room(n, server.data_port, "--data-port (node i takes it + 2i, and + 2i + 1)", "")
    host_id = server.host_id or socket.gethostname()
    advertise = server.advertise_host or server.host
    if advertise in _WILDCARDS:
        advertise = socket.gethostname()
    cluster_map = LocalCluster(
        n, replication=cluster.replication if cluster.etcd else min(cluster.replication, n),
        data_dir=server.data_dir, base_port=server.data_port, etcd=cluster.etcd,
        etcd_prefix=cluster.etcd_prefix, lease_ttl_s=cluster.lease_ttl_s,
        serve_args=[*_without_nodes(argv), *_shares(config, n)], log_level=server.log_level,
        host_ids=[host_id] * n, advertise=advertise,
        name_prefix=f"{host_id}-n" if cluster.etcd else "n", keep_env=True)
    source = f"etcd {cluster.etcd}" if cluster.etcd else \
        f"a map of their own ({cluster_map.map_file})"
    print(f"kvpool: starting {n} nodes on host {host_id!r}, each with 1/{n} of the memory and "
          f"disk one node would take; cluster map: {source}", flush=True)
    return _run(cluster_map, restart=True)


def _check_room(n: int, base_port: int, flag: str, dram: str) -> None:
    """Before any node starts: the ports the nodes will take are free, and their DRAM
    together fits the machine (``dram``: each node's --dram-capacity, '' = a fraction)."""
    from kvpool.cli.local_cluster import busy_ports

    if base_port:
        busy = busy_ports(range(base_port, base_port + 2 * n))
        if busy:
            raise ConfigError(f"port{'s' if len(busy) > 1 else ''} "
                              f"{', '.join(map(str, busy))} on 127.0.0.1 "
                              f"{'are' if len(busy) > 1 else 'is'} in use (another kvpool "
                              f"node?): the {n} nodes need ports {base_port}-"
                              f"{base_port + 2 * n - 1}; pick others with {flag}")
    if dram:
        total = memory_limit()
        each = parse_size(dram)
        if n * each > total:
            raise ConfigError(f"{n} nodes of --dram-capacity {format_size(each)} need "
                              f"{format_size(n * each)}, more than the memory they may use "
                              f"({format_size(total)}, the machine's or its container's "
                              "limit): lower --dram-capacity")


def _shares(config: NodeConfig, n: int) -> list[str]:
    """Each node's 1/n of what one node would take (appended last: these flags win)."""
    dram, ssd = config.dram, config.ssd
    out = ["--dram-capacity", str(dram.capacity_bytes // n)] if dram.capacity_bytes else \
        ["--dram-fraction", f"{dram.capacity_fraction / n:.6g}"]
    if ssd.enabled:
        out += ["--ssd-capacity", str(ssd.capacity_bytes // n)] if ssd.capacity_bytes else \
            ["--ssd-fraction", f"{ssd.capacity_fraction / n:.6g}"]
    return out


def _without_nodes(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif word == "--nodes":
            skip = True
        elif not word.startswith("--nodes="):
            out.append(word)
    return out


def _run(cluster: LocalCluster, *, restart: bool) -> int:
    """Start the nodes, print where they are, watch them until SIGINT/SIGTERM, stop them."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    def report(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    where = cluster.data_dir.resolve()
    with cluster:
        for node in cluster.nodes:
            pid = node.proc.pid if node.proc is not None else "-"
            print(f"  {node.node_id}  data={node.seed}  admin={node.admin_url}  "
                  f"dir={node.data_dir}  pid={pid}", flush=True)
        print(f"kvpool: cluster ready, seeds kvpool://{','.join(cluster.seeds)}", flush=True)
        print("kvpool: Ctrl-C stops every node"
              + ("" if restart else "; a node that dies stays down (--no-restart)"),
              flush=True)
        cluster.supervise(stop, restart=restart, report=report)
    print(f"kvpool: cluster stopped; its data stays in {where} (rm -r {where} to remove it)",
          flush=True)
    return 0
