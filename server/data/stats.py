"""Plain integer counters of the data path (an OTel call per chunk costs 20-30 us here).

:mod:`kvpool.server.admin.metrics` exports them; the data path never calls OpenTelemetry.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

from kvpool.protocol.errors import Status
from kvpool.protocol.frames import Op

__all__ = ["LATENCY_BUCKETS", "NodeStats"]

#: upper bounds (seconds) of the request-latency histogram buckets; the last bucket is +Inf
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(slots=True)
class NodeStats:
    # keyed by opcode: Op(op).name.lower() per request cost more than the rest of a small op
    requests: dict[int, int] = field(default_factory=lambda: dict.fromkeys(map(int, Op), 0))
    keys: dict[int, int] = field(default_factory=lambda: dict.fromkeys(map(int, Op), 0))
    errors: dict[str, int] = field(default_factory=dict)
    #: (op, status) -> replies with that error status
    op_errors: dict[tuple[int, int], int] = field(default_factory=dict)
    #: op -> counts per LATENCY_BUCKETS bucket (+Inf last), and the sum of seconds
    latency: dict[int, list[int]] = field(
        default_factory=lambda: {op: [0] * (len(LATENCY_BUCKETS) + 1) for op in map(int, Op)})
    latency_sum: dict[int, float] = field(default_factory=lambda: dict.fromkeys(map(int, Op), 0.0))
    timed: bool = True  #: record request latencies (off with --no-metrics)
    tokens_served: int = 0  #: tokens in the chunks GET returned (prefill the engines skipped)
    #: THE hit and miss counts (stats, status, /v1/stats and /metrics all show these): a hit
    #: is a chunk a read asked for and got, from any tier, by any path -- GET over TCP,
    #: GET_SHM, a read through the arena index (reported by TOUCH); a miss, one no tier had
    hits: int = 0
    misses: int = 0
    lookup_chunks_found: int = 0  #: chunks LOOKUP and EXISTS reported present
    bytes_in: int = 0
    bytes_out: int = 0
    connections_open: int = 0
    connections_total: int = 0
    connections_rejected: int = 0  #: closed at accept: --max-connections were open
    connections_timed_out: int = 0  #: closed by the HELLO, idle or slow-frame timeouts
    protocol_errors: int = 0

    def count(self, op: int, num_keys: int) -> None:
        self.requests[op] += 1
        self.keys[op] += num_keys

    def error(self, status: int, op: int = 0) -> None:
        name = Status(status).name.lower() if status in Status._value2member_map_ else str(status)
        self.errors[name] = self.errors.get(name, 0) + 1
        if op:
            self.op_errors[op, status] = self.op_errors.get((op, status), 0) + 1

    def observe(self, op: int, seconds: float) -> None:
        """One request of ``op`` took ``seconds`` (parse to reply queued)."""
        self.latency[op][bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum[op] += seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": {Op(op).name.lower(): n for op, n in self.requests.items()},
            "keys": {Op(op).name.lower(): n for op, n in self.keys.items()},
            "errors": dict(self.errors),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "connections": {"open": self.connections_open, "total": self.connections_total,
                            "rejected": self.connections_rejected,
                            "timed_out": self.connections_timed_out},
            "protocol_errors": self.protocol_errors,
            "tokens_served": self.tokens_served,
            "hits": self.hits,
            "misses": self.misses,
            "lookup_chunks_found": self.lookup_chunks_found,
        }
