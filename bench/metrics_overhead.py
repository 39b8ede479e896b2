"""Throughput with metrics on vs off, in the same run.

Two nodes, one with metrics (OpenTelemetry provider, latency buckets, a scrape
of /metrics every second while it is measured) and one with ``--no-metrics``;
the runs alternate between them. Workloads: single-key 4 KiB GETs (where
per-request costs show) and get_many_into of 16 x 1 MiB (bulk).

    python -m kvpool.bench.metrics_overhead      # ~2 minutes; --quick for a smoke run

Prints a table and writes bench/results/metrics_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvpool.bench._procs import Proc, start_node
from kvpool.client import Client

RESULTS = Path(__file__).resolve().parent / "results"


class Scraper:
    """GET /metrics once a second while running (a harsher rate than Prometheus' 15 s)."""

    def __init__(self, admin_url: str) -> None:
        self.url = admin_url + "/metrics"
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            with urllib.request.urlopen(self.url, timeout=10) as reply:
                reply.read()
            self.scrapes += 1

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def small_gets(client: Client, keys: list[bytes], seconds: float) -> float:
    buf = bytearray(4096)
    n = 0
    deadline = time.perf_counter() + seconds
    t0 = time.perf_counter()
    while time.perf_counter() < deadline:
        for key in keys:
            client.get_into(key, buf)
        n += len(keys)
    return n / (time.perf_counter() - t0)


def bulk_gets(client: Client, keys: list[bytes], rounds: int) -> float:
    bufs = [bytearray(1 << 20) for _ in keys]
    t0 = time.perf_counter()
    for _ in range(rounds):
        client.get_many_into(keys, bufs)
    return rounds * len(keys) * (1 << 20) / (time.perf_counter() - t0) / 1e9


def measure(node: Proc, with_scraper: bool, seconds: float, rounds: int) -> dict[str, float]:
    with Client(node.url) as client:
        small = [os.urandom(16) for _ in range(64)]
        client.put_many(small, [os.urandom(4096) for _ in small])
        bulk = [os.urandom(16) for _ in range(16)]
        client.put_many(bulk, [os.urandom(1 << 20) for _ in bulk])
        if with_scraper:
            with Scraper(node.admin_url):
                ops = small_gets(client, small, seconds)
                gbs = bulk_gets(client, bulk, rounds)
        else:
            ops = small_gets(client, small, seconds)
            gbs = bulk_gets(client, bulk, rounds)
        client.delete_many(small + bulk)
    return {"small_ops_s": ops, "bulk_gbs": gbs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--seconds", type=float, default=3.0, help="per small-GET run")
    parser.add_argument("--rounds", type=int, default=20, help="bulk rounds per run")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "metrics_overhead.json")
    args = parser.parse_args()
    runs, seconds, rounds = (2, 1.0, 4) if args.quick else (args.runs, args.seconds, args.rounds)
    on = start_node("--dram-capacity", "256MiB", "--no-ssd")
    off = start_node("--dram-capacity", "256MiB", "--no-ssd", "--no-metrics")
    results: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    try:
        for i in range(runs):
            order = [("on", on), ("off", off)] if i % 2 == 0 else [("off", off), ("on", on)]
            for name, node in order:
                results[name].append(measure(node, name == "on", seconds, rounds))
            print(f"  run {i + 1}/{runs}: done", flush=True)
    finally:
        on.stop()
        off.stop()
    table: dict[str, Any] = {}
    lines = ["| workload | metrics on, median [min-max] | metrics off | on / off |",
             "|---|---|---|---|"]
    for field, label, unit in (("small_ops_s", "get_into 4 KiB, one key per call", "ops/s"),
                               ("bulk_gbs", "get_many_into 16 x 1 MiB", "GB/s")):
        row: dict[str, Any] = {}
        for name in ("on", "off"):
            values = [r[field] for r in results[name]]
            row[name] = {"median": statistics.median(values), "min": min(values),
                         "max": max(values)}
        row["ratio"] = row["on"]["median"] / row["off"]["median"]
        table[field] = row
        fmt = "{:.0f}" if unit == "ops/s" else "{:.2f}"
        cells = [f"{fmt.format(row[n]['median'])} [{fmt.format(row[n]['min'])}-"
                 f"{fmt.format(row[n]['max'])}] {unit}" for n in ("on", "off")]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {row['ratio']:.3f} |")
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": runs, "results": results, "table": table,
                                    "when": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
