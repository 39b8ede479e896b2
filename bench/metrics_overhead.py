"""Throughput with metrics on vs off, and with tracing on, in the same run.

Three nodes, measured in turn (the order rotates each run):
- ``on``: the default -- metrics (OpenTelemetry provider, latency buckets, a
  scrape of /metrics every second while it is measured), tracing off;
- ``off``: ``--no-metrics``;
- ``traced``: metrics, and every request traced -- the client has an SDK
  tracer provider that samples everything and exports by OTLP, the node
  exports its spans by OTLP; both to an OTLP/HTTP sink on 127.0.0.1.
Workloads: single-key 4 KiB GETs (where per-request costs show) and
get_many_into of 16 x 1 MiB (bulk). It also times, in-process, what tracing
off adds to every client call: the check for a tracer provider and for a
current span.

    python -m bench.metrics_overhead      # ~2 minutes; --quick for a smoke run

Prints a table and writes bench/results/metrics_overhead.json.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import statistics
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from bench._procs import Proc, start_node
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


class OtlpSink:
    """An OTLP/HTTP endpoint on 127.0.0.1 that counts export requests and drops them."""

    def __init__(self) -> None:
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                sink.requests += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.requests = 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def tracing_off_cost_us(n: int = 200_000) -> float:
    """What one client call pays with tracing off: the provider check + the span check."""
    from kvpool.client import AsyncClient
    from kvpool.client._tracing import tracer_for, wire_context

    owner = AsyncClient()  # never connected: only its (absent) tracer provider is read
    t0 = time.perf_counter()
    for _ in range(n):
        tracer_for(owner)
        wire_context()
    return (time.perf_counter() - t0) / n * 1e6


def measure(node: Proc, with_scraper: bool, seconds: float, rounds: int,
            provider: TracerProvider | None = None) -> dict[str, float]:
    with Client(node.url, tracer_provider=provider) as client:
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
    sink = OtlpSink()
    nodes = {
        "on": start_node("--dram-capacity", "256MiB", "--no-ssd"),
        "off": start_node("--dram-capacity", "256MiB", "--no-ssd", "--no-metrics"),
        "traced": start_node("--dram-capacity", "256MiB", "--no-ssd",
                             env={"OTEL_EXPORTER_OTLP_ENDPOINT": sink.url}),
    }
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=sink.url + "/v1/traces")))
    names = list(nodes)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    try:
        for i in range(runs):
            for name in names[i % 3:] + names[: i % 3]:
                results[name].append(measure(nodes[name], name != "off", seconds, rounds,
                                             provider if name == "traced" else None))
            print(f"  run {i + 1}/{runs}: done", flush=True)
    finally:
        for node in nodes.values():
            node.stop()
        provider.shutdown()
        sink.close()
    off_cost = tracing_off_cost_us()
    table: dict[str, Any] = {"tracing_off_cost_us_per_call": off_cost,
                             "otlp_export_requests": sink.requests}
    lines = ["| workload | metrics on (default), median [min-max] | metrics off | on / off "
             "| every request traced | traced / on |",
             "|---|---|---|---|---|---|"]
    for field, label, unit in (("small_ops_s", "get_into 4 KiB, one key per call", "ops/s"),
                               ("bulk_gbs", "get_many_into 16 x 1 MiB", "GB/s")):
        row: dict[str, Any] = {}
        for name in names:
            values = [r[field] for r in results[name]]
            row[name] = {"median": statistics.median(values), "min": min(values),
                         "max": max(values)}
        row["ratio"] = row["on"]["median"] / row["off"]["median"]
        row["traced_ratio"] = row["traced"]["median"] / row["on"]["median"]
        table[field] = row
        fmt = "{:.0f}" if unit == "ops/s" else "{:.2f}"
        cells = [f"{fmt.format(row[n]['median'])} [{fmt.format(row[n]['min'])}-"
                 f"{fmt.format(row[n]['max'])}] {unit}" for n in names]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {row['ratio']:.3f} | {cells[2]} "
                     f"| {row['traced_ratio']:.3f} |")
    print("\n".join(lines))
    print(f"tracing off adds {off_cost:.2f} us to each client call (provider + span check); "
          f"{sink.requests} OTLP export requests received while traced")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": runs, "results": results, "table": table,
                                    "when": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
