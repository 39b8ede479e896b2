"""What one connection costs a node, by kind: the figures behind docs/security.md.

    python -m bench.conn_memory [--connections 400] [--runs 3]

For each kind, a fresh node (DRAM only) is started, its RSS read, ``--connections``
connections of that kind opened and held, and its RSS read again once it has settled;
the growth divided by the number of connections is the cost of one. Kinds:

- ``silent``: TCP connections that never send a byte (not authenticated);
- ``put-header``: TCP connections that send, without HELLO, a PUT header announcing a
  60 MiB value and no body (the node refuses it and closes; counted while it does);
- ``hello``: authenticated TCP connections, idle;
- ``tls-non-reader``: TLS connections (40 of them) that each ask for one 4 MiB value 76
  times and never read a byte.

Median [min-max] over ``--runs`` runs; written to ``bench/results/conn_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import ssl
import statistics
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench._procs import Proc, start_node
from kvpool.client import Client

RESULTS = Path(__file__).resolve().parent / "results"
FRAME = struct.Struct("<2sBBIIIQ")
PUT_ITEM = struct.Struct("<16sQII")
TLS_CONNECTIONS = 40


def _settled_rss(pid: int) -> int:
    time.sleep(1.0)
    return int(psutil.Process(pid).memory_info().rss)


def _open(kind: str, node: Proc, n: int, context: ssl.SSLContext | None) -> list[socket.socket]:
    hello = json.dumps({"protocol": 1}).encode()
    hello_frame = FRAME.pack(b"KV", 1, 0, 1, 0, 0, len(hello)) + hello
    key = b"conn-memory-bait"
    socks: list[socket.socket] = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", node.port), timeout=10)
        if kind == "put-header":
            s.sendall(FRAME.pack(b"KV", 2, 0, 2, 1, 0, PUT_ITEM.size + (60 << 20))
                      + PUT_ITEM.pack(b"x" * 16, 60 << 20, 0, 0))
        elif kind == "hello":
            s.sendall(hello_frame)
        elif kind == "tls-non-reader":
            assert context is not None
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            s = context.wrap_socket(s, server_hostname="127.0.0.1")
            s.sendall(hello_frame + FRAME.pack(b"KV", 3, 0, 2, 64, 0, 16 * 64) + key * 64
                      + FRAME.pack(b"KV", 3, 0, 3, 12, 0, 16 * 12) + key * 12)
        socks.append(s)
    return socks


def measure(kind: str, connections: int, tmp: str) -> float:
    flags = ["--dram-capacity", "64MiB", "--no-ssd", "--data-dir",
             tempfile.mkdtemp(dir=tmp), "--max-connections", str(connections + 16)]
    context = None
    if kind == "tls-non-reader":
        import trustme

        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1")
        pem, ca_pem = os.path.join(tmp, "node.pem"), os.path.join(tmp, "ca.pem")
        cert.private_key_and_cert_chain_pem.write_to_path(pem)
        ca.cert_pem.write_to_path(ca_pem)
        flags += ["--tls-cert", pem, "--tls-key", pem]
        context = ssl.create_default_context(cafile=ca_pem)
        connections = TLS_CONNECTIONS
    node = start_node(*flags)
    try:
        with Client(node.url, ssl=context, shm=False) as c:
            c.put(b"conn-memory-bait", os.urandom(4 << 20))
        before = _settled_rss(node.proc.pid)
        socks = _open(kind, node, connections, context)
        after = _settled_rss(node.proc.pid)
        for s in socks:
            s.close()
        return (after - before) / connections
    finally:
        node.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=400)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "conn_memory.json"))
    args = parser.parse_args()
    kinds = ("silent", "put-header", "hello", "tls-non-reader")
    per: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="kvpool-conn-memory-") as tmp:
        for _ in range(args.runs):  # kinds in turn within a run, runs repeated
            for kind in kinds:
                per[kind].append(measure(kind, args.connections, tmp))
    rows: dict[str, Any] = {}
    print(f"\nnode RSS growth per connection ({args.connections} connections a kind, "
          f"{TLS_CONNECTIONS} for TLS; {args.runs} runs)\n")
    print("| connection | KiB each, median [min-max] |\n|---|---|")
    for kind, values in per.items():
        kib = [v / 1024 for v in values]
        rows[kind] = {"median_kib": round(statistics.median(kib), 1),
                      "min_kib": round(min(kib), 1), "max_kib": round(max(kib), 1)}
        print(f"| {kind} | {rows[kind]['median_kib']} [{rows[kind]['min_kib']}-"
              f"{rows[kind]['max_kib']}] |")
    RESULTS.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({"connections": args.connections,
                                          "tls_connections": TLS_CONNECTIONS,
                                          "runs": args.runs, "per_connection": rows}, indent=2))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
