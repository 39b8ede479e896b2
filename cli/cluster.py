"""``kvpool status`` and ``kvpool drain`` (also as ``kvpool cluster status|drain``): a
cluster -- or one standalone node, a one-node map -- seen through any node's admin API.

Exit codes: 0 done, 1 the drain failed, 2 a node could not be reached or refused the
request, 3 timed out waiting.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvpool.cli.admin_http import (
    DEFAULT_ADMIN,
    AdminError,
    add_admin_args,
    admin_base,
    admin_bases,
    call_first,
    call_with_args,
)
from kvpool.placement.cluster_map import NodeInfo
from kvpool.protocol.errors import ConfigError
from kvpool.server.config import format_size

__all__ = ["LOCAL_CLUSTER_FILE", "add_cluster_commands", "hit_rate"]

#: where ``kvpool cluster up`` writes its map by default
LOCAL_CLUSTER_FILE = Path("kvpool-cluster") / "cluster.toml"


def known_admins(args: argparse.Namespace) -> list[str]:
    """The admin URLs to ask, in order: ``--admin`` (comma-separated), then, when it was not
    given, every node of the local cluster ``kvpool cluster up`` runs from this directory."""
    bases = admin_bases(args.admin)
    if args.admin == DEFAULT_ADMIN and LOCAL_CLUSTER_FILE.is_file():
        from kvpool.placement.cluster_map import ClusterMap

        try:
            local = ClusterMap.from_toml(LOCAL_CLUSTER_FILE)
        except (ConfigError, OSError, ValueError):
            return bases
        bases += [b for b in (admin_base(n.admin) for n in local.nodes) if b not in bases]
    return bases


def _status(args: argparse.Namespace) -> int:
    bases = known_admins(args)
    try:
        asked, cmap = call_first(args, "/v1/cluster", bases=bases)
    except AdminError as exc:
        print(f"kvpool cluster status: {exc}", file=sys.stderr)
        return 2
    if asked != bases[0]:
        print(f"kvpool: {bases[0]} did not answer; the map is {asked}'s", file=sys.stderr)
    rows = []
    for node in cmap["nodes"]:
        try:
            stats: dict[str, Any] | None = call_with_args(
                args, admin_base(node["admin"], asked) + "/v1/stats")
        except AdminError:
            stats = None
        rows.append((node, stats))
    if args.json:
        print(json.dumps({"cluster": cmap, "stats": {n["id"]: s for n, s in rows}}, indent=2))
        return 2 if any(stats is None for _, stats in rows) else 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvpool cluster: epoch {cmap['epoch']}, replication "
                  f"{cmap['replication']}, source {cmap.get('source', '?')}")
    draining = any((stats or {}).get("drain", {}).get("state", "idle") != "idle"
                   for _, stats in rows)
    # a standalone node's id is its data address: one column says both
    show_data = any(node["id"] != node["data"] for node, _ in rows)
    # ids and addresses are never cut; sizes take two lines; the drain column only shows
    # while a node drains: a standalone node's row fits 80 columns
    # failure domains only where the map names some: zone/rack/host as placement sees them
    show_domain = any(node.get(label) for node, _ in rows for label in ("host", "rack", "zone"))
    table.add_column("node", no_wrap=True)
    table.add_column("state")
    if show_data:
        table.add_column("data", no_wrap=True)
    if show_domain:
        table.add_column("host", no_wrap=True)
    for column in ("DRAM", "SSD"):  # used / capacity
        table.add_column(column, no_wrap=True)
    table.add_column("objects", no_wrap=True)
    table.add_column("hit rate", no_wrap=True, min_width=6)  # "100.0%" whole
    if draining:
        table.add_column("drain")
    for node, stats in rows:
        data = [node["data"]] if show_data else []
        if show_domain:
            data.append(domain_label(node))
        if stats is None:  # whatever the map says, nobody answers there
            table.add_row(node["id"], "[red]down[/]", *data, "[red]unreachable[/]", "", "",
                          "", *([""] if draining else []))
            continue
        drain = stats.get("drain", {})
        moving = "" if drain.get("state", "idle") == "idle" else \
            f"{drain['state']} {drain['chunks_moved']}/{drain['chunks_total']}"
        table.add_row(node["id"], node["state"], *data,
                      _usage(stats["tiers"].get("dram")), _usage(stats["tiers"].get("ssd")),
                      str(stats["num_objects"]), hit_rate(stats),
                      *([moving] if draining else []))
    Console().print(table)
    down = sum(1 for node, stats in rows if stats is None)
    return 2 if down else 0


def domain_label(node: dict[str, Any]) -> str:
    """A map entry's failure domains as placement sees them (``NodeInfo.domain``): its
    host, under zone/rack/ where the map names them."""
    zone, rack, host = NodeInfo(**node).domain
    return "/".join((zone or "-", rack or "-", host)) if zone or rack else host


def _usage(tier: dict[str, Any] | None) -> str:
    if not tier or "used_bytes" not in tier:
        return "-"
    return f"{format_size(tier['used_bytes'])} /\n{format_size(tier['capacity_bytes'])}"


def hit_rate(stats: dict[str, Any]) -> str:
    """The node's hit rate, as ``kvpool stats`` shows it: chunks reads got, from any tier
    and by any path, over chunks they asked for."""
    asked = stats["hits"] + stats["misses"]
    return f"{stats['hits'] / asked:.1%}" if asked else "-"


def _drain(args: argparse.Namespace) -> int:
    try:
        base, cmap = call_first(args, "/v1/cluster/drain", {"id": args.node})
    except AdminError as exc:
        print(f"kvpool cluster drain: {exc}", file=sys.stderr)
        return 2
    node = next((n for n in cmap["nodes"] if n["id"] == args.node), None)
    if node is None:  # already gone (a drain of an empty node can finish at once)
        print(f"kvpool: {args.node} is no longer in the map (epoch {cmap['epoch']})")
        return 0
    if args.no_wait:
        print(f"kvpool: {args.node} is {node['state']} (epoch {cmap['epoch']})")
        return 0
    stats_url = admin_base(node["admin"], base) + "/v1/stats"
    deadline = time.monotonic() + args.wait
    progress: dict[str, Any] = {}
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("chunks"), DownloadColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=args.json or not sys.stdout.isatty()) as bar:
        task = bar.add_task(f"draining {args.node}", total=None)
        while True:
            try:
                progress = call_with_args(args, stats_url).get("drain", {})
            except AdminError:
                progress = {**progress, "state": "gone"}  # stopped after leaving the map
            done = (progress.get("chunks_moved", 0) + progress.get("chunks_skipped", 0)
                    + progress.get("chunks_failed", 0))
            bar.update(task, total=progress.get("chunks_total") or None, completed=done)
            if progress.get("state") in ("done", "failed", "gone"):
                break
            if time.monotonic() > deadline:
                print(f"kvpool cluster drain: still {progress.get('state')} after {args.wait} s",
                      file=sys.stderr)
                return 3
            time.sleep(args.interval)
    if args.json:
        print(json.dumps({"node": args.node, **progress}, indent=2))
    else:
        print(f"kvpool: {args.node} {progress.get('state')}: {progress.get('chunks_moved', 0)} "
              f"chunks ({format_size(progress.get('bytes_moved', 0))}) handed off, "
              f"{progress.get('chunks_skipped', 0)} gone before their turn, "
              f"{progress.get('chunks_failed', 0)} failed"
              + (f" ({progress['error']})" if progress.get("error") else ""))
    return 1 if progress.get("state") == "failed" else 0


def add_cluster_commands(csub: Any) -> None:
    """Add ``status`` and ``drain`` to a set of sub-parsers (top level, and ``cluster``)."""
    status = csub.add_parser(
        "status", help="every node: state, tier use, objects, hit rate",
        description="Read the cluster map from one node's admin API (a standalone node serves "
        "a one-node map), then every node's stats. Exit codes: 0 every node answered, "
        "2 some node (or the one asked) could not be reached.")
    add_admin_args(status)
    status.add_argument("--json", action="store_true", help="print raw JSON")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds per request")
    status.set_defaults(func=_status)

    drain = csub.add_parser(
        "drain", help="drain a node (etcd clusters) and follow its hand-off",
        description="Mark NODE draining through any node's admin API (POST /v1/cluster/drain); "
        "NODE then hands its DRAM chunks to their new owners and leaves the map. Shows a "
        "progress bar until the hand-off is done. Exit codes: 0 done, 1 failed, 2 refused or "
        "unreachable, 3 timed out.")
    drain.add_argument("node", help="id of the node to drain")
    add_admin_args(drain, token=True)
    drain.add_argument("--no-wait", action="store_true", help="return once the map says draining")
    drain.add_argument("--wait", type=float, default=3600.0,
                       help="seconds to follow the hand-off before giving up (default: 3600)")
    drain.add_argument("--interval", type=float, default=0.5, help="seconds between polls")
    drain.add_argument("--json", action="store_true", help="print the final progress as JSON")
    drain.add_argument("--timeout", type=float, default=10.0, help="seconds per request")
    drain.set_defaults(func=_drain)
