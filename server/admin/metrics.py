"""A node's metrics through OpenTelemetry: Prometheus at ``GET /metrics``, OTLP when configured.

The data path only bumps plain counters (:mod:`kvpool.server.data.stats`); an OTel
``add()`` costs 20-30 us here, more than a small request. This module turns
those counters into OpenTelemetry *observable* instruments, read when a
reader collects: the Prometheus reader (on a registry of its own) on every
scrape, and a periodic OTLP exporter when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``) is set, with the standard ``OTEL_*``
variables for headers and intervals. Request latency histograms are kept as
bucket counts by the data path and exposed on ``/metrics`` by a Prometheus
collector on the same registry (OpenTelemetry's Python SDK has no
pre-aggregated histogram to feed them through).

``METRICS`` is the one table of names: docs/observability.md's metrics table is generated
from it (:func:`metrics_table`) and a test keeps them in step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from kvpool.protocol.errors import Status
from kvpool.protocol.frames import Op
from kvpool.server.data.stats import LATENCY_BUCKETS

__all__ = ["METRICS", "CONTENT_TYPE", "Metric", "MetricsFeed", "NodeMetrics", "metrics_table"]

log = logging.getLogger("kvpool.server")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Sample = tuple[float, dict[str, str]]
Snapshot = dict[str, Any]
_OPS = {int(op): op.name.lower() for op in Op}
_STATUS = {int(s): s.name.lower() for s in Status}


@dataclass(frozen=True)
class Metric:
    name: str  #: the OpenTelemetry instrument name; Prometheus adds the unit and _total
    kind: str  #: "counter" or "gauge"
    unit: str  #: "" or "By" (bytes) or "s"
    labels: str  #: label names, for the docs
    help: str
    read: Callable[[Snapshot], Iterable[Sample]]

    @property
    def prometheus_name(self) -> str:
        name = self.name + {"By": "_bytes", "s": "_seconds"}.get(self.unit, "")
        return name + "_total" if self.kind == "counter" else name


def _tiers(snap: Snapshot) -> dict[str, dict[str, Any]]:
    tiers: dict[str, dict[str, Any]] = snap["tiers"]
    return tiers


def _per_tier(field: str, *, tiers: tuple[str, ...] = ("dram", "ssd", "s3")
              ) -> Callable[[Snapshot], Iterable[Sample]]:
    def read(snap: Snapshot) -> Iterator[Sample]:
        for name, tier in _tiers(snap).items():
            if name in tiers and isinstance(tier.get(field), (int, float)):
                yield tier[field], {"tier": name}
    return read


def _one(field: str) -> Callable[[Snapshot], Iterable[Sample]]:
    return lambda snap: [(snap[field], {})]


def _received(snap: Snapshot) -> Iterator[Sample]:
    shm = snap["shm"]["bytes_in"] if "shm" in snap else 0
    yield snap["bytes_in"] - shm, {"path": "tcp"}
    if "shm" in snap:
        yield shm, {"path": "shm"}


def _shm_sent(snap: Snapshot) -> int:
    """GET_SHM replies, and reads through the arena index the clients reported (TOUCH)."""
    return snap["shm"]["bytes_out"] + snap["shm"]["index_bytes_out"] if "shm" in snap else 0


def _sent(snap: Snapshot) -> Iterator[Sample]:
    yield snap["bytes_out"], {"path": "tcp"}
    if "shm" in snap:
        yield _shm_sent(snap), {"path": "shm"}


def _shm(field: str) -> Callable[[Snapshot], Iterable[Sample]]:
    return lambda snap: [(snap["shm"][field], {})] if "shm" in snap else []


def _shm_index(field: str) -> Callable[[Snapshot], Iterable[Sample]]:
    return lambda snap: [(snap["shm"]["index"][field], {})] \
        if "shm" in snap and snap["shm"]["index"] else []


def _requests(snap: Snapshot) -> Iterator[Sample]:
    errors: dict[tuple[int, int], int] = snap["_op_errors"]
    failed: dict[int, int] = {}
    for (op, status), n in errors.items():
        failed[op] = failed.get(op, 0) + n
        yield n, {"op": _OPS.get(op, str(op)), "status": _STATUS.get(status, str(status))}
    for op, n in snap["_requests"].items():
        if n:
            yield max(0, n - failed.get(op, 0)), {"op": _OPS[op], "status": "ok"}


def _keys(snap: Snapshot) -> Iterator[Sample]:
    for op, n in snap["_keys"].items():
        if n:
            yield n, {"op": _OPS[op]}


def _tier_read_bytes(snap: Snapshot) -> Iterator[Sample]:
    # every GET is served from DRAM (after promotion), over TCP or through shared memory
    yield snap["bytes_out"] + _shm_sent(snap), {"tier": "dram"}
    tiers = _tiers(snap)
    if "ssd" in tiers:
        yield tiers["ssd"].get("read_bytes", 0), {"tier": "ssd"}


def _tier_written_bytes(snap: Snapshot) -> Iterator[Sample]:
    yield snap["bytes_in"], {"tier": "dram"}
    tiers = _tiers(snap)
    if "ssd" in tiers:
        yield tiers["ssd"].get("write_bytes", 0), {"tier": "ssd"}


def _cold(field_ssd: str, field_s3: str) -> Callable[[Snapshot], Iterable[Sample]]:
    """A counter of the SSD tier and (where it has one, ``field_s3`` given) of S3."""
    def read(snap: Snapshot) -> Iterator[Sample]:
        tiers = _tiers(snap)
        if "ssd" in tiers:
            yield tiers["ssd"].get(field_ssd, 0), {"tier": "ssd"}
        if "s3" in tiers and field_s3:
            yield tiers["s3"].get(field_s3, 0), {"tier": "s3"}
    return read


def _nodes(snap: Snapshot) -> Iterator[Sample]:
    counts = dict.fromkeys(("up", "draining", "down"), 0)
    for state in snap["_node_states"]:
        counts[state] = counts.get(state, 0) + 1
    for state, n in counts.items():
        yield n, {"state": state}


METRICS: tuple[Metric, ...] = (
    Metric("kvpool_requests", "counter", "", "op, status",
           "data-path requests by op and reply status (ok, or the error)", _requests),
    Metric("kvpool_request_keys", "counter", "", "op", "keys (batch items) carried by requests",
           _keys),
    Metric("kvpool_received", "counter", "By", "path", "PUT payload bytes stored (envelopes "
           "included), by path: tcp (received on the socket), shm (written by co-located "
           "clients into the arena)", _received),
    Metric("kvpool_sent", "counter", "By", "path", "GET payload bytes served, by path: tcp "
           "(sent on the socket), shm (read by co-located clients from shared memory)",
           _sent),
    Metric("kvpool_shm_leases_expired", "counter", "", "", "fast-path leases ended by their "
           "deadline (a reader slow or gone)", _shm("expired")),
    Metric("kvpool_shm_denied", "counter", "", "", "fast-path grants refused (user not "
           "allowed to map the arena)", _shm("denied")),
    Metric("kvpool_shm_index_entries", "gauge", "", "", "DRAM values published in the arena "
           "index (read by co-located clients with no request)", _shm_index("entries")),
    Metric("kvpool_shm_index_set_full", "counter", "", "", "values the arena index had no "
           "slot for (their set was full: read with GET_SHM instead)", _shm_index("set_full")),
    Metric("kvpool_hits", "counter", "", "", "chunks reads asked for and got, from any tier, "
           "by any path (TCP, shared memory, the arena index): the hits of kvpool stats and "
           "kvpool status", _one("hits")),
    Metric("kvpool_misses", "counter", "", "", "chunks reads asked for that no tier held",
           _one("misses")),
    Metric("kvpool_tier_read", "counter", "By", "tier", "bytes read from a tier (DRAM: sent "
           "to clients, by either path; SSD: promoted)", _tier_read_bytes),
    Metric("kvpool_tier_written", "counter", "By", "tier", "bytes written into a tier (DRAM: "
           "PUTs; SSD: write-behind)", _tier_written_bytes),
    Metric("kvpool_tier_hits", "counter", "", "tier", "reads a tier answered with the chunk "
           "(DRAM: before promotion; a chunk promoted from SSD is a DRAM miss, an SSD hit)",
           _per_tier("hits")),
    Metric("kvpool_tier_misses", "counter", "", "tier", "lookups a tier did not hold",
           _per_tier("misses")),
    Metric("kvpool_tier_used", "gauge", "By", "tier", "bytes held by a tier",
           _per_tier("used_bytes")),
    Metric("kvpool_tier_capacity", "gauge", "By", "tier", "a tier's capacity (S3: unbounded, "
           "not reported)", _per_tier("capacity_bytes", tiers=("dram", "ssd"))),
    Metric("kvpool_tier_objects", "gauge", "", "tier", "chunks held by a tier",
           _per_tier("num_objects")),
    Metric("kvpool_pinned_objects", "gauge", "", "tier", "pinned chunks",
           _per_tier("num_pinned", tiers=("dram",))),
    Metric("kvpool_evictions", "counter", "", "tier", "chunks evicted to make room",
           _per_tier("evictions")),
    Metric("kvpool_expirations", "counter", "", "tier", "chunks dropped when their TTL ran out",
           _per_tier("expirations", tiers=("dram",))),
    Metric("kvpool_demotions", "counter", "", "tier", "chunks written behind to a colder tier",
           _cold("writes", "insertions")),
    Metric("kvpool_promotions", "counter", "", "", "chunks copied up into DRAM on a GET",
           _one("promotions")),
    Metric("kvpool_pending_writes", "gauge", "", "tier", "write-behind queue depth (chunks)",
           _cold("pending_writes", "")),
    Metric("kvpool_pending_write", "gauge", "By", "tier", "write-behind queue depth (bytes)",
           _cold("pending_write_bytes", "pending_bytes")),
    Metric("kvpool_shed_writes", "counter", "", "tier", "write-behinds dropped because the "
           "queue was full (the chunk stays in DRAM only)", _cold("shed", "shed")),
    Metric("kvpool_held_back_writes", "counter", "", "tier", "chunks not written below at "
           "their PUT: no reuse shown yet (--ssd-admit reused)", _cold("held_back", "")),
    Metric("kvpool_checksum_failures", "counter", "", "tier", "chunks that failed their "
           "checksum when read from a tier", _per_tier("corrupt", tiers=("ssd", "s3"))),
    Metric("kvpool_tier_errors", "counter", "", "tier", "I/O errors of a cold tier (S3: "
           "failed requests)", _per_tier("errors", tiers=("ssd", "s3"))),
    Metric("kvpool_prefill_tokens_served", "counter", "", "", "tokens in the chunks GETs "
           "returned: prefill the engines did not recompute", _one("tokens_served")),
    Metric("kvpool_lookup_chunks_found", "counter", "", "", "chunks LOOKUP and EXISTS "
           "reported present", _one("lookup_chunks_found")),
    Metric("kvpool_cluster_epoch", "gauge", "", "", "the cluster map epoch this node serves "
           "(0 = standalone)", _one("cluster_epoch")),
    Metric("kvpool_cluster_nodes", "gauge", "", "state", "nodes in the cluster map by state",
           _nodes),
    Metric("kvpool_wrong_owner", "counter", "", "", "requests refused with WRONG_OWNER",
           _one("wrong_owner")),
    Metric("kvpool_connections_open", "gauge", "", "", "open data-path connections",
           lambda snap: [(snap["connections"]["open"], {})]),
    Metric("kvpool_connections", "counter", "", "", "data-path connections accepted",
           lambda snap: [(snap["connections"]["total"], {})]),
    Metric("kvpool_connections_rejected", "counter", "", "", "data-path connections closed at "
           "accept because --max-connections were open",
           lambda snap: [(snap["connections"]["rejected"], {})]),
    Metric("kvpool_connections_timed_out", "counter", "", "", "data-path connections closed "
           "by the HELLO, idle or slow-frame timeouts",
           lambda snap: [(snap["connections"]["timed_out"], {})]),
    Metric("kvpool_auth_failures", "counter", "", "", "HELLOs refused for a missing or "
           "unknown token", lambda snap: [(snap["auth"]["failures"], {})]),
    Metric("kvpool_protocol_errors", "counter", "", "", "connections closed on a protocol "
           "error", _one("protocol_errors")),
    Metric("kvpool_events_lost", "counter", "", "", "KV events dropped for slow /v1/events "
           "listeners", lambda snap: [(snap["events"]["lost"], {})]),
    Metric("kvpool_event_subscribers_dropped", "counter", "", "", "/v1/events listeners "
           "dropped for falling a whole queue behind",
           lambda snap: [(snap["events"]["dropped"], {})]),
    Metric("kvpool_uptime", "gauge", "s", "", "seconds since the node started",
           _one("uptime_s")),
)
HISTOGRAM_NAME = "kvpool_request_duration_seconds"


class _LatencyCollector(Collector):
    """``kvpool_request_duration_seconds{op}`` from the data path's own buckets."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            HISTOGRAM_NAME, "data-path request latency, frame parsed to reply queued",
            labels=["op"])
        snap = self._metrics.last
        for op, counts in snap.get("_latency", {}).items():
            total = sum(counts)
            if not total:
                continue
            cumulative, buckets = 0, []
            for bound, n in zip((*LATENCY_BUCKETS, float("inf")), counts, strict=True):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            family.add_metric([_OPS[op]], buckets, snap["_latency_sum"][op])
        yield family

    def describe(self) -> list[HistogramMetricFamily]:
        return []


class NodeMetrics:
    """The node's MeterProvider, its readers and the /metrics rendering."""

    def __init__(self, node_id: str) -> None:
        self.registry = CollectorRegistry()
        readers: list[MetricReader] = [PrometheusMetricReader(
            registry=self.registry, disable_target_info=True, scope_info_enabled=False)]
        self.otlp = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                         or os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"))
        if self.otlp:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        resource = Resource.create({"service.name": "kvpool", "service.instance.id": node_id})
        self.provider = MeterProvider(metric_readers=readers, resource=resource)
        meter = self.provider.get_meter("kvpool")
        #: the snapshot the instruments read; refreshed before each scrape (and by the node
        #: every few seconds when OTLP is on), read by exporter threads as a whole
        self.last: Snapshot = {}
        for metric in METRICS:
            callback = self._callback(metric)
            if metric.kind == "counter":
                meter.create_observable_counter(metric.name, callbacks=[callback],
                                                unit=metric.unit, description=metric.help)
            else:
                meter.create_observable_gauge(metric.name, callbacks=[callback],
                                              unit=metric.unit, description=metric.help)
        self.registry.register(_LatencyCollector(self))

    def _callback(self, metric: Metric) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            snap = self.last
            if not snap:
                return []
            return [Observation(value, attrs) for value, attrs in metric.read(snap)]
        return observe

    def update(self, snapshot: Snapshot, stats: Any, node_states: list[str]) -> None:
        """Install a new snapshot (call on the event loop; copies what the loop mutates)."""
        self.last = {**snapshot, "_op_errors": dict(stats.op_errors),
                     "_requests": dict(stats.requests), "_keys": dict(stats.keys),
                     "_latency": {op: list(c) for op, c in stats.latency.items()},
                     "_latency_sum": dict(stats.latency_sum), "_node_states": node_states}

    def render(self) -> bytes:
        """The Prometheus text exposition of the current snapshot."""
        return bytes(generate_latest(self.registry))

    def shutdown(self) -> None:
        self.provider.shutdown()


def metrics_table() -> str:
    """The metrics as a markdown table (docs/observability.md's copy is generated from this)."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for m in METRICS:
        rows.append(f"| `{m.prometheus_name}` | {m.kind} | {m.labels} | {m.help} |")
    rows.append(f"| `{HISTOGRAM_NAME}` | histogram | op | data-path request latency, frame "
                "parsed to reply queued (Prometheus only) |")
    return "\n".join(rows) + "\n"


class MetricsFeed:
    """What keeps a node's :class:`NodeMetrics` current: a fresh snapshot for each scrape
    (:meth:`text`) and, with OTLP on, every ``interval_s`` for the exporter's thread.
    ``snapshot``: the op table's counters; ``stats``: the data path's; ``node_states``:
    the state of each node of the map."""

    def __init__(self, metrics: NodeMetrics, snapshot: Callable[[], Awaitable[Snapshot]],
                 stats: Any, node_states: Callable[[], list[str]], *,
                 interval_s: float) -> None:
        self.metrics = metrics
        self._snapshot, self._stats, self._states = snapshot, stats, node_states
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        self.metrics.update(await self._snapshot(), self._stats, self._states())

    async def text(self) -> bytes:
        """The Prometheus exposition, from counters read now."""
        await self.refresh()
        return self.metrics.render()

    def start(self) -> None:
        if self.metrics.otlp:
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # keep exporting the last snapshot; say why it is stale
                log.exception("metrics snapshot failed")
            await asyncio.sleep(self.interval_s)

    async def stop_refreshing(self) -> None:
        """No more periodic refreshes (the node is stopping what they read)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def close(self, *, final: bool) -> None:
        """``final``: one last refresh, so the last export sees the final counters; then
        shut the exporters down."""
        await self.stop_refreshing()
        if final:
            await self.refresh()
        self.metrics.shutdown()
