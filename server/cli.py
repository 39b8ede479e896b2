"""The ``kvpool`` command: ``serve`` runs a node, ``stats`` shows one node's counters."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from kvpool.protocol.errors import ConfigError
from kvpool.server.config import add_arguments, format_size, load_config

__all__ = ["main"]


def _serve(args: argparse.Namespace) -> int:
    from kvpool.server.node import run_node

    run_node(load_config(args))
    return 0


def _fetch(url: str, timeout: float) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        data: dict[str, Any] = json.load(response)
        return data


def _stats(args: argparse.Namespace) -> int:
    url = args.admin.rstrip("/") + "/v1/stats"
    try:
        stats = _fetch(url, args.timeout)
    except (OSError, urllib.error.URLError, json.JSONDecodeError) as exc:
        print(f"kvpool stats: cannot read {url}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    from rich.console import Console
    from rich.table import Table

    lookups = stats["hits"] + stats["misses"]
    table = Table(title=f"kvpool node {stats['node_id']}", show_header=False)
    table.add_row("DRAM used / capacity",
                  f"{format_size(stats['used_bytes'])} / {format_size(stats['capacity_bytes'])}")
    table.add_row("objects", str(stats["num_objects"]))
    table.add_row("hit rate", f"{stats['hits'] / lookups:.1%}" if lookups else "-")
    table.add_row("evictions", str(stats["evictions"]))
    table.add_row("bytes in / out",
                  f"{format_size(stats['bytes_in'])} / {format_size(stats['bytes_out'])}")
    table.add_row("connections open", str(stats["connections"]["open"]))
    table.add_row("requests", ", ".join(f"{k}={v}" for k, v in stats["requests"].items() if v))
    Console().print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description="kvpool: a KV-cache store for "
                                     "LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="run a node (DRAM tier on 127.0.0.1:7700, admin on :7701)",
        description="Run one kvpool node. Every knob can also be set in the TOML file "
        "(--config) or a KVPOOL_* environment variable; flags win over env, env over the file.")
    add_arguments(serve)
    serve.set_defaults(func=_serve)
    stats = sub.add_parser("stats", help="show a node's counters (reads its admin API)")
    stats.add_argument("--admin", default="http://127.0.0.1:7701", help="admin URL of the node")
    stats.add_argument("--json", action="store_true", help="print raw JSON")
    stats.add_argument("--timeout", type=float, default=5.0, help="seconds")
    stats.set_defaults(func=_stats)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"kvpool: configuration error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
