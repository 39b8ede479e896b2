"""The narrow interface every tier implements, and the stats it reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["Tier", "TierStats"]


@dataclass(slots=True)
class TierStats:
    name: str
    capacity_bytes: int
    used_bytes: int = 0
    allocated_bytes: int = 0
    num_objects: int = 0
    num_pinned: int = 0
    hits: int = 0
    misses: int = 0
    insertions: int = 0
    evictions: int = 0
    expirations: int = 0
    rejections: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class Tier(Protocol):
    """get / put / delete / contains / stats. Values are whole envelopes."""

    name: str

    def get(self, key: bytes) -> bytes | None: ...

    def put(self, key: bytes, value: bytes | bytearray | memoryview) -> bool: ...

    def delete(self, key: bytes) -> bool: ...

    def contains(self, key: bytes) -> bool: ...

    def stats(self) -> TierStats: ...
