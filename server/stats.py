"""Plain integer counters of the data path (an OTel call per chunk costs 20-30 us here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpool.protocol.errors import Status
from kvpool.protocol.frames import Op

__all__ = ["NodeStats"]


@dataclass(slots=True)
class NodeStats:
    # keyed by opcode: Op(op).name.lower() per request cost more than the rest of a small op
    requests: dict[int, int] = field(default_factory=lambda: dict.fromkeys(map(int, Op), 0))
    keys: dict[int, int] = field(default_factory=lambda: dict.fromkeys(map(int, Op), 0))
    errors: dict[str, int] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0
    connections_open: int = 0
    connections_total: int = 0
    protocol_errors: int = 0

    def count(self, op: int, num_keys: int) -> None:
        self.requests[op] += 1
        self.keys[op] += num_keys

    def error(self, status: int) -> None:
        name = Status(status).name.lower() if status in Status._value2member_map_ else str(status)
        self.errors[name] = self.errors.get(name, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": {Op(op).name.lower(): n for op, n in self.requests.items()},
            "keys": {Op(op).name.lower(): n for op, n in self.keys.items()},
            "errors": dict(self.errors),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "connections": {"open": self.connections_open, "total": self.connections_total},
            "protocol_errors": self.protocol_errors,
        }
